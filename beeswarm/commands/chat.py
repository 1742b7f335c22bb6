"""`beeswarm chat`: generate through a swarm; this machine holds the embedding, head and sampler."""
from __future__ import annotations

import argparse
import json
from typing import Any

from beeswarm.commands import options
from beeswarm.commands.common import UserError, interactive, required_join, swarm_secret
from beeswarm.commands.entry import chat_common, check_model, encode_prompt, speculation, start_client, swarm_model


def add_parser(sub) -> argparse.ArgumentParser:
    chat = sub.add_parser("chat", help="generate text through a swarm")
    options.add_join(chat, "the swarm to use")
    chat.add_argument("--model", default=None, help="must match the swarm's model (default: the swarm's)")
    chat.add_argument("--prompt", default=None, help="generate once for TEXT (default: the chat app)")
    options.add_sampling(chat)
    options.add_spec(chat)
    options.add_audit(chat)
    chat.add_argument("--client-hops", action="store_true",
                      help="route every stage's output back through this machine (for comparison)")
    chat.add_argument("--micro-batches", type=int, default=None, metavar="M",
                      help="cut the prompt into M chunks that pipeline across stages (default: the plan's)")
    options.add_device(chat)
    options.add_secret(chat)
    options.add_heartbeat(chat)
    chat.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    options.add_payer(chat)
    options.add_entry_addrs(chat)
    chat.set_defaults(func=run)
    return chat


def run(args) -> int:
    """Generate through a swarm: this machine holds the embedding, head and sampler."""
    if args.prompt is None and not interactive():
        raise UserError("give --prompt TEXT (the chat app needs a terminal)")
    bootstrap, descriptor = required_join(args.join, "the swarm to generate through")
    secret = swarm_secret(args.swarm_secret_env)
    if args.model is None:
        args.model = descriptor.model if descriptor else swarm_model(args, bootstrap, secret)
    params, entry = chat_common(args)
    draft, tuner = speculation(args, entry)
    client = start_client(args, entry, bootstrap, draft, tuner, secret=secret,
                          mode="hops" if args.client_hops else "push", micro_batches=args.micro_batches)
    try:
        check_model(client, entry, args.model)
        if args.prompt is None:
            return chat_app(client, entry, args, params)
        return run_chat(client, entry, args, params)
    finally:
        client.close()


NO_SPEC: dict[str, Any] = {"rounds": None, "accepted_per_round": None, "acceptance_by_depth": [], "spec": None}


def run_chat(client, entry, args, params) -> int:
    """Generate once through the swarm and print the stream or the JSON summary."""
    from beeswarm.client.dataplane import StageFailed
    from beeswarm.client.swarm import NoRoute
    from beeswarm.client.textstream import TextStream, stop_ids

    tokenizer, ids = encode_prompt(entry, args)
    stream = TextStream(tokenizer)
    echo = stream.push if args.json else (lambda t: print(stream.push(t), end="", flush=True))

    def rewind(keep: int) -> None:
        kept = stream.rewind(keep)
        if not args.json:
            print(f"\n[a stage was caught computing wrong by an audit: the reply is generated again from here]\n"
                  f"{kept}", end="", flush=True)

    try:
        out = client.generate(ids, args.max_new_tokens, params, stop_ids(tokenizer), echo, on_rewind=rewind)
    except NoRoute as e:
        client.node.raise_if_failed()  # no route because this process's node stopped: exit 1, not 2
        raise UserError(f"{e}; is the swarm up? (check --join)") from None
    except StageFailed as e:
        client.node.raise_if_failed()
        raise UserError(f"the swarm kept failing: {e}") from None
    g = out.generation
    if args.json:
        print(json.dumps({"text": stream.text, "tokens": g.tokens, "new_tokens": len(g.tokens),
                          "seconds": round(g.seconds, 4), "tokens_per_s": round(g.tokens_per_s, 2),
                          "ttft_s": round(g.ttft_s, 4),
                          "route": [{"peer": s.node, "start": s.span.start, "end": s.span.end} for s in out.route],
                          "recoveries": out.recoveries, "wire_bytes": out.wire_bytes, "raw_bytes": out.raw_bytes,
                          "audits": client.audits.as_json(),
                          **(out.spec.as_json() if out.spec else NO_SPEC)}))
    else:
        print(stream.flush())
    return 0


def chat_app(client, entry, args, params, side_panel: bool = False) -> int:
    """The Textual chat; returns when the user leaves (the caller closes the client and any swarm)."""
    from transformers import AutoTokenizer

    from beeswarm.client.chat import ChatSession
    from beeswarm.tui.chat_app import ChatApp

    session = ChatSession(client, AutoTokenizer.from_pretrained(str(entry.folder)), params, args.max_new_tokens)
    app = ChatApp(session, swarm_rows=session.swarm_rows if side_panel else None,
                  ring_ms=lambda: session.ring_ms(app.last_reply.route if app.last_reply else ()))
    client.node.when_failed(lambda error: app.call_from_thread(app.exit))  # the node stopped: so does the app
    app.run()
    client.node.raise_if_failed()
    return 0
