"""`beeswarm serve`: an OpenAI-compatible HTTP API over a swarm; this machine is the entry for every request."""
from __future__ import annotations

import argparse
import json
import os

from beeswarm.commands import options
from beeswarm.commands.common import UserError, required_join, swarm_secret
from beeswarm.commands.entry import check_model, speculation, start_client, swarm_model


def add_parser(sub) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="an OpenAI-compatible API (/v1/chat/completions) over a swarm")
    options.add_join(serve, "the swarm to serve")
    serve.add_argument("--model", default=None, help="must match the swarm's model (default: the swarm's)")
    options.add_serve(serve)
    options.add_spec(serve)
    options.add_audit(serve)
    options.add_device(serve)
    options.add_secret(serve)
    options.add_heartbeat(serve)
    serve.add_argument("--json", action="store_true", help="print the serving line as a JSON object")
    options.add_payer(serve)
    options.add_entry_addrs(serve)
    serve.set_defaults(func=run)
    return serve


def run(args) -> int:
    """An OpenAI-compatible HTTP API over the swarm: this machine is the entry for every request."""
    from beeswarm.shard import EntryModel

    key = api_key(args.api_key_env)
    bootstrap, descriptor = required_join(args.join, "the swarm to serve")
    secret = swarm_secret(args.swarm_secret_env)
    if args.model is None:
        args.model = descriptor.model if descriptor else swarm_model(args, bootstrap, secret)
    entry = EntryModel.load(args.model, args.dtype, args.device)
    draft, tuner = speculation(args, entry)
    client = start_client(args, entry, bootstrap, draft, tuner, secret=secret)
    try:
        check_model(client, entry, args.model)
        return serve_api(client, entry, args, key)
    finally:
        client.close()


def api_key(env_name: str | None) -> str | None:
    if env_name is None:
        return None
    key = os.environ.get(env_name, "")
    if not key:
        raise UserError(f"--api-key-env {env_name}: that environment variable is empty or unset")
    return key


def serve_api(client, entry, args, api_key: str | None) -> int:
    """Serve HTTP until Ctrl-C or SIGTERM (uvicorn's own handlers stop it gracefully)."""
    import signal
    import socket

    import uvicorn
    from transformers import AutoTokenizer

    from beeswarm.api.app import Api
    from beeswarm.api.engine import Completer

    if args.max_concurrent < 1:
        raise UserError("--max-concurrent must be at least 1")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    completer = Completer(client, AutoTokenizer.from_pretrained(str(entry.folder)), args.model)
    app = Api(completer, api_key, args.max_concurrent).app()
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level=args.log_level.lower(),
                                           access_log=args.log_level in ("DEBUG", "INFO"),
                                           timeout_graceful_shutdown=5))
    print(json.dumps({"event": "serving", "url": url, "model": args.model}) if args.json
          else f"serving {url} (model {args.model}); Ctrl-C stops", flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down: SIGTERM then means "done", exit 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    client.node.raise_if_failed()
    return 0
