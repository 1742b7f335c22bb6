"""The `beeswarm` command line."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import beeswarm
from beeswarm.protocol.membership import QUANT_FORMATS, Quant

log = logging.getLogger("beeswarm")


SWARM_SECRET = "swarm-secret"
SWARM_SECRET_ENV = "BEESWARM_SWARM_SECRET"


class UserError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (default: sample)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="default: the model's generation config, else 0.8")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="default: the model's, else 0.95")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="above 1 makes tokens already in the text less likely, greedy too (default: the model's, "
                        "else 1: none)")
    p.add_argument("--seed", type=int, default=None, metavar="S")


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one)")
    p.add_argument("--api-key-env", default=None, metavar="NAME",
                   help="require `Authorization: Bearer KEY`, KEY read from environment variable NAME")
    p.add_argument("--max-concurrent", type=int, default=8, metavar="N",
                   help="requests generated at once; more get 429 (default: 8)")


def _add_entry_addrs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                   help="where this entry's node listens (stages connect back to it)")
    p.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="an address peers should dial (a port-forward or a public address)")


QUANT_HELP = ("the weights' format every contributor serves: none (the checkpoint's), int8 (weight-only, "
              "per-channel scales; CPU and CUDA) or nf4 (4-bit; meant for CUDA)")


def _add_quant(p: argparse.ArgumentParser, default: str | None = "none") -> None:
    p.add_argument("--quant", choices=QUANT_FORMATS, default=default,
                   help=QUANT_HELP + (f" (default: {default})" if default else " (default: the swarm's, else none)"))


def _audit_rate(text: str) -> float:
    rate = float(text)
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a probability between 0 and 1")
    return rate


def _add_audit(p: argparse.ArgumentParser) -> None:
    from beeswarm.audit import DEFAULT_RATE

    p.add_argument("--audit-rate", type=_audit_rate, default=DEFAULT_RATE, metavar="P",
                   help=f"check each stage's steps with probability P by recomputing them (default {DEFAULT_RATE}; "
                        "0: off)")


def _add_spec(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-spec", action="store_true", help="no speculative decoding (same as --draft none)")
    p.add_argument("--draft", default=None, metavar="REF",
                   help="draft model sharing the target's tokenizer (default: the model's paired draft; none: off)")
    p.add_argument("--spec-depth", default="auto", metavar="K|auto", help="draft tree depth (default: tuned)")
    p.add_argument("--spec-width", default="auto", metavar="W|auto",
                   help="children per tree node, 1 for a chain (default: tuned)")
    p.add_argument("--spec-in-flight", default="auto", metavar="D|auto",
                   help="speculative steps kept in flight around the ring, 1 for serial rounds (default: tuned, "
                        "pipelined only where it measures faster)")


def _speculation(args, entry):
    """(draft model or None, tuner) from --no-spec / --draft / --spec-depth / --spec-width / --spec-in-flight."""
    from beeswarm.shard.errors import ShardError
    from beeswarm.spec.draft import DraftModel, draft_ref
    from beeswarm.spec.tuner import MAX_DEPTH, MAX_IN_FLIGHT, MAX_WIDTH, Tuner

    def pinned(value: str, flag: str, most: int) -> int | None:
        if value == "auto":
            return None
        if not value.isdigit() or not 1 <= int(value) <= most:
            raise UserError(f"{flag} must be auto or 1..{most}, got {value!r}")
        return int(value)

    tuner = Tuner(depth=pinned(args.spec_depth, "--spec-depth", MAX_DEPTH),
                  width=pinned(args.spec_width, "--spec-width", MAX_WIDTH),
                  in_flight=pinned(args.spec_in_flight, "--spec-in-flight", MAX_IN_FLIGHT))
    ref = None if args.no_spec else draft_ref(args.model, args.draft)
    if ref is None:
        return None, tuner
    try:
        return DraftModel(ref, entry.config.vocab_size, "float32", "cpu"), tuner
    except ShardError as e:
        raise UserError(f"draft: {e}") from None


def _sampling(args, entry):
    """The flags, or where a flag is not given the model's generation config (e.g. tinycode's tuned values)."""
    from beeswarm.decoding.sampling import ModelDefaults

    try:
        return ModelDefaults.read(entry.folder).sampling(0.0 if args.greedy else args.temperature, args.top_p,
                                                         args.repetition_penalty, args.seed, fallback=(0.8, 0.95))
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_demo(args) -> int:
    """A real local swarm of 3 contributor processes plus this process as the entry; stopped after."""
    import torch

    from beeswarm.client.swarm import ClientOptions, SwarmClient
    from beeswarm.contributor.local import LocalSwarm, LocalSwarmError, threads_per_process

    params, entry = _chat_common(args)
    if args.serve:
        api_key = _api_key(args.api_key_env)  # a missing key fails before any process starts
    elif args.prompt is not None:
        _encode_prompt(entry, args)  # fail on a bad prompt before starting anything
    elif not _interactive():
        raise UserError("give --prompt TEXT or --serve (the chat app needs a terminal)")
    draft, tuner = _speculation(args, entry)  # a bad flag fails before any process starts
    stages = min(3, entry.config.num_hidden_layers)
    swarm = LocalSwarm(stages, args.model, heartbeat=1.0, device=args.device, quant=args.quant)
    torch.set_num_threads(threads_per_process(stages + 1))  # the entry shares the cores with the stages
    client = None
    try:
        print(f"starting a local swarm of {stages} contributors for {args.model} "
              f"(logs in {swarm.state_dir})...", file=sys.stderr, flush=True)
        bootstrap = swarm.start()
        swarm.wait_ready()
        client = SwarmClient.create(entry, [bootstrap], interval=1.0, listen=args.listen or ["/ip4/127.0.0.1/tcp/0"],
                                    announce=args.announce, options=ClientOptions(audit_rate=args.audit_rate),
                                    draft=draft, tuner=tuner).start()
        if args.serve:
            return _serve_api(client, entry, args, api_key)
        if args.prompt is not None:
            return _run_chat(client, entry, args, params)
        return _chat_app(client, entry, args, params, side_panel=True)
    except LocalSwarmError as e:
        raise UserError(str(e)) from None
    finally:
        if client is not None:
            client.close()
        swarm.stop()


def cmd_plan(args) -> int:
    """Plan a cluster described in JSON: who hosts which layers, and how fast it will be."""
    from beeswarm.coordinator.cluster import ClusterError, parse_cluster
    from beeswarm.coordinator.planner import PlanError, plan

    try:
        text = sys.stdin.read() if args.cluster == "-" else open(args.cluster, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"cannot read {args.cluster}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{args.cluster}: not valid JSON ({e})") from None
    try:
        result = plan(parse_cluster(data))
    except (ClusterError, PlanError) as e:
        raise UserError(f"{args.cluster}: {e}") from None
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    how = "exact" if result.exact else "heuristic"
    print(f"objective: {result.objective}   solved in {result.solve_ms:.1f} ms ({how})")
    for i, p in enumerate(result.pipelines):
        print(f"\npipeline {i + 1}: {p.micro_batches} micro-batch(es), step {p.step_ms:.2f} ms, "
              f"{p.tokens_per_s:.2f} tokens/s")
        print(f"  {'node':24} {'layers':>12} {'offload':>8}")
        for s in p.stages:
            print(f"  {s.node:24} {str(s.span):>12} {s.offload_fraction:>7.0%}")
    if len(result.pipelines) > 1:
        print(f"\ntotal: {result.tokens_per_s:.2f} tokens/s")
    for left_out in result.excluded:
        print(f"left out: {left_out.node}: {left_out.reason}")
    return 0


def _secret(env_name: str | None) -> bytes | None:
    """The swarm secret: --swarm-secret-env NAME, else the stored one, else None (an open swarm)."""
    from beeswarm import secrets

    if env_name:
        value = os.environ.get(env_name)
        if not value:
            raise UserError(f"--swarm-secret-env {env_name}: that environment variable is empty or unset")
        return value.encode()
    try:
        stored = secrets.load(SWARM_SECRET, SWARM_SECRET_ENV)
    except secrets.SecretError as e:
        raise UserError(str(e)) from None
    return stored.value if stored else None


def cmd_contribute(args) -> int:
    """Join (or start) a swarm and serve the layers the coordinator assigns."""
    import signal

    from beeswarm.contributor.process import Contributor, ContributorOptions
    from beeswarm.p2p import identity
    from beeswarm.p2p.descriptor import DescriptorError, resolve_join

    try:
        bootstrap, descriptor = resolve_join(args.join)
    except DescriptorError as e:
        raise UserError(str(e)) from None
    model = args.model or (descriptor.model if descriptor else "tinycode")
    quant: Quant = args.quant or (descriptor.quant if descriptor else "none")
    options = ContributorOptions(model=model, join=bootstrap, listen=args.listen or ["/ip4/0.0.0.0/tcp/0"],
                                 announce=args.announce, relays=args.relay, device=args.device, dtype=args.dtype,
                                 quant=quant,
                                 max_memory=args.max_memory, secret=_secret(args.swarm_secret_env),
                                 interval=args.heartbeat)
    dashboard = not args.headless and _interactive()
    if dashboard:  # a model that cannot be found is one line of error, not a screen opened and closed
        from beeswarm.shard import checkpoint

        checkpoint.resolve_config(model)
    if dashboard:
        say = lambda event: logging.getLogger("beeswarm").info("%s", event.text)  # noqa: E731
    else:
        say = lambda event: print(event.json() if args.json_events else event.text, flush=True)  # noqa: E731
    contributor = Contributor.create(identity.load_or_create(), options, say=say)
    signal.signal(signal.SIGTERM, lambda *_: contributor.stop())  # leave gracefully, as Ctrl-C or `q` does
    if dashboard:
        return _dashboard(contributor)
    signal.signal(signal.SIGINT, lambda *_: contributor.stop())
    contributor.run()
    return 0


def _dashboard(contributor) -> int:
    """The Textual dashboard; the log goes to its panel instead of stderr while it runs."""
    from beeswarm.p2p.errors import NodeFailed
    from beeswarm.shard.errors import ShardError
    from beeswarm.tui.dashboard_app import DashboardApp

    root = logging.getLogger()
    streams = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    level = root.level
    for h in streams:
        root.removeHandler(h)
    root.setLevel(min(level, logging.INFO))
    try:
        app = DashboardApp(contributor)
        app.run()
    finally:
        root.setLevel(level)
        for h in streams:
            root.addHandler(h)
    if isinstance(app.failure, ShardError | NodeFailed):
        raise app.failure
    if app.failure is not None:
        raise UserError(f"the contributor stopped: {app.failure}")
    return 0


def cmd_swarm(args) -> int:
    """Start N contributors on this machine; stop them all on Ctrl-C or SIGTERM."""
    import signal
    import threading

    from beeswarm.contributor.local import LocalSwarm, LocalSwarmError

    swarm = LocalSwarm(args.local, args.model, args.base_port, heartbeat=args.heartbeat, device=args.device,
                       quant=args.quant)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def say(text: str, event: str, **fields: object) -> None:
        print(json.dumps({"event": event, **fields}) if args.json else text, flush=True)

    try:
        bootstrap = swarm.start()
        say(f"bootstrap {bootstrap}", "bootstrap", addr=bootstrap)
        path = swarm.write_descriptor(bootstrap)
        say(f"descriptor {path}", "descriptor", path=str(path))
        swarm.wait_ready()
        for c in swarm.children:
            assert c.span is not None  # wait_ready saw every span
            say(f"contributor {c.index} pid {c.process.pid} peer {c.peer} layers {c.span}", "contributor",
                index=c.index, pid=c.process.pid, peer=c.peer, start=c.span.start, end=c.span.end)
        say("ready", "ready")
        while not stop.wait(0.5):
            if any(c.process.poll() is not None for c in swarm.children):
                log.warning("a contributor exited; the swarm re-plans around it")
    except LocalSwarmError as e:
        raise UserError(str(e)) from None
    finally:
        swarm.stop()
    return 0


def _chat_common(args):
    from beeswarm.shard import EntryModel

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    entry = EntryModel.load(args.model, args.dtype, args.device)
    return _sampling(args, entry), entry


def _encode_prompt(entry, args):
    """The tokenizer and the prompt's ids, checked against the model's context."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(entry.folder))
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise UserError("the prompt is empty")
    if len(ids) + args.max_new_tokens > entry.config.max_position_embeddings:
        raise UserError(f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds the model's "
                        f"{entry.config.max_position_embeddings}-token context")
    return tokenizer, ids


NO_SPEC: dict[str, Any] = {"rounds": None, "accepted_per_round": None, "acceptance_by_depth": [], "spec": None}


def _run_chat(client, entry, args, params) -> int:
    """Generate once through the swarm and print the stream or the JSON summary."""
    from beeswarm.client.remote import StageFailed
    from beeswarm.client.swarm import NoRoute
    from beeswarm.client.textstream import TextStream, stop_ids

    tokenizer, ids = _encode_prompt(entry, args)
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


def _required_join(join: list[str], what: str):
    """Bootstrap addresses (and the descriptor, if a URL was given) from --join, which must be given."""
    from beeswarm.p2p.descriptor import DescriptorError, resolve_join

    try:
        bootstrap, descriptor = resolve_join(join)
    except DescriptorError as e:
        raise UserError(str(e)) from None
    if not bootstrap:
        raise UserError(f"--join MULTIADDR|URL is required: {what}")
    return bootstrap, descriptor


def cmd_chat(args) -> int:
    """Generate through a swarm: this machine holds the embedding, head and sampler."""
    from beeswarm.client.swarm import ClientOptions, SwarmClient

    if args.prompt is None and not _interactive():
        raise UserError("give --prompt TEXT (the chat app needs a terminal)")
    bootstrap, descriptor = _required_join(args.join, "the swarm to generate through")
    if args.model is None:
        args.model = descriptor.model if descriptor else "tinycode"
    params, entry = _chat_common(args)
    draft, tuner = _speculation(args, entry)
    options = ClientOptions(mode="hops" if args.client_hops else "push", micro_batches=args.micro_batches,
                            audit_rate=args.audit_rate)
    client = SwarmClient.create(entry, bootstrap, secret=_secret(args.swarm_secret_env), interval=args.heartbeat,
                                listen=args.listen or None, announce=args.announce, options=options, draft=draft,
                                tuner=tuner).start()
    try:
        if args.prompt is None:
            return _chat_app(client, entry, args, params)
        return _run_chat(client, entry, args, params)
    finally:
        client.close()


def _api_key(env_name: str | None) -> str | None:
    if env_name is None:
        return None
    key = os.environ.get(env_name, "")
    if not key:
        raise UserError(f"--api-key-env {env_name}: that environment variable is empty or unset")
    return key


def cmd_serve(args) -> int:
    """An OpenAI-compatible HTTP API over the swarm: this machine is the entry for every request."""
    from beeswarm.client.swarm import ClientOptions, SwarmClient
    from beeswarm.shard import EntryModel

    api_key = _api_key(args.api_key_env)
    bootstrap, descriptor = _required_join(args.join, "the swarm to serve")
    if args.model is None:
        args.model = descriptor.model if descriptor else "tinycode"
    entry = EntryModel.load(args.model, args.dtype, args.device)
    draft, tuner = _speculation(args, entry)
    client = SwarmClient.create(entry, bootstrap, secret=_secret(args.swarm_secret_env), interval=args.heartbeat,
                                listen=args.listen or None, announce=args.announce,
                                options=ClientOptions(audit_rate=args.audit_rate), draft=draft, tuner=tuner).start()
    try:
        return _serve_api(client, entry, args, api_key)
    finally:
        client.close()


def _serve_api(client, entry, args, api_key: str | None) -> int:
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


def cmd_status(args) -> int:
    """The swarm at a glance: join as a client, listen until the plan is heard (or --wait), print, leave."""
    import time

    from beeswarm.client.status import SwarmObserver, Unreachable
    from beeswarm.p2p.errors import NodeError

    bootstrap, _ = _required_join(args.join, "the swarm to look at")
    if args.wait <= 0 or args.every <= 0:
        raise UserError("--wait and --every must be positive")
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    observer = SwarmObserver.create(bootstrap, secret=_secret(args.swarm_secret_env), interval=args.heartbeat)
    try:
        observer.start()
        observer.wait(args.wait)
        while True:
            report = observer.report()
            if args.json:
                print(json.dumps(report.as_json()), flush=True)
            else:
                if args.watch and color:
                    print("\033[H\033[2J", end="")  # redraw in place
                print("\n".join(report.lines(color)), flush=True)
            if not args.watch:
                return 0
            if not args.json and not color:
                print(flush=True)
            time.sleep(args.every)
    except Unreachable as e:
        raise UserError(str(e)) from None
    except NodeError as e:
        raise UserError(f"cannot join the swarm: {e}") from None
    except KeyboardInterrupt:
        return 0 if args.watch else 130
    finally:
        observer.close()


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _chat_app(client, entry, args, params, side_panel: bool = False) -> int:
    """The Textual chat; returns when the user leaves (the caller closes the client and any swarm)."""
    from transformers import AutoTokenizer

    from beeswarm.client.chat import ChatSession
    from beeswarm.tui.chat_app import ChatApp

    session = ChatSession(client, AutoTokenizer.from_pretrained(str(entry.folder)), params, args.max_new_tokens)
    app = ChatApp(session, swarm_rows=session.swarm_rows if side_panel else None,
                  ring_ms=lambda: session.ring_ms(app.last_reply.route if app.last_reply else ()))
    client.node.on_failure.append(lambda error: app.call_from_thread(app.exit))  # the node stopped: so does the app
    app.run()
    client.node.raise_if_failed()
    return 0


def cmd_bench(args) -> int:
    """Measure this machine for the planner: per-layer compute, memory, offload bandwidth."""
    from dataclasses import asdict

    from beeswarm.shard import benchmark

    result = benchmark.run(args.model, args.device, args.dtype, refresh=args.refresh, weights=args.quant,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    offload = f"{result.offload_gbps} GB/s" if result.offload_gbps else "n/a (CPU)"
    print(f"{result.model} on {result.device} ({result.dtype}){' [cached]' if result.cached else ''}\n"
          f"  per layer:  {result.layer_ms_base:.3f} ms + {result.layer_ms_per_token:.4f} ms/token\n"
          f"  memory:     {result.mem_bytes / 2**30:.1f} GiB free, {result.host_mem_bytes / 2**30:.1f} GiB host\n"
          f"  offload:    {offload}\n"
          f"  layer size: {result.layer_bytes / 2**20:.1f} MiB"
          f"{f' ({result.quant} weights)' if result.quant != 'none' else ''}, "
          f"KV {result.kv_bytes_per_token_layer} B/token/layer")
    return 0


def cmd_identity(args) -> int:
    """Show or replace this machine's node key, or set the swarm secret."""
    from beeswarm import secrets
    from beeswarm.p2p import identity

    try:
        if args.action == "show":
            me = identity.load_or_create()
            secret = secrets.load(SWARM_SECRET, SWARM_SECRET_ENV)
            print(f"peer id:      {me.peer_id}")
            print(f"key stored:   {me.location}")
            print(f"swarm secret: {secret.location if secret else 'none (open swarms only)'}")
        elif args.action == "reset":
            if not args.yes:
                if not sys.stdin.isatty():
                    raise UserError("identity reset changes this node's peer id: pass --yes to confirm")
                if input("Replace this node's key? Its peer id will change. [y/N] ").strip().lower() != "y":
                    print("kept the current key")
                    return 1
            me = identity.reset()
            print(f"new peer id: {me.peer_id} (key stored: {me.location})")
        elif args.action == "secret":
            if args.clear:
                secrets.delete(SWARM_SECRET)
                print("swarm secret removed")
                return 0
            if sys.stdin.isatty():
                import getpass

                value = getpass.getpass("swarm secret: ")
            else:
                value = sys.stdin.readline().rstrip("\n")
            if len(value) < 8:
                raise UserError("a swarm secret needs at least 8 characters")
            print(f"swarm secret stored: {secrets.store(SWARM_SECRET, value.encode())}")
    except secrets.SecretError as e:
        raise UserError(str(e)) from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="beeswarm",
                                     description="Run one large language model across volunteer machines.")
    parser.add_argument("--version", action="version", version=f"beeswarm {beeswarm.__version__}")
    parser.add_argument("--log-level", default=os.environ.get("BEESWARM_LOG_LEVEL", "WARNING"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log detail on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="start a local swarm of 3 contributor processes and generate through it")
    demo.add_argument("--model", default="tinycode", help="built-in name, checkpoint folder or hub id (org/name)")
    demo.add_argument("--prompt", default=None, help="generate once for TEXT (default: the chat app)")
    _add_sampling(demo)
    _add_spec(demo)
    _add_audit(demo)
    demo.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    demo.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    _add_quant(demo)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    demo.add_argument("--serve", action="store_true", help="serve the OpenAI-compatible API instead of chatting")
    _add_serve(demo)
    _add_entry_addrs(demo)
    demo.set_defaults(func=cmd_demo, client_hops=False, heartbeat=1.0)

    swarm = sub.add_parser("swarm", help="run a swarm of contributor processes on this machine")
    swarm.add_argument("--local", type=int, required=True, metavar="N", help="number of contributor processes")
    swarm.add_argument("--model", default="tinycode", help="built-in name, folder or hub id")
    swarm.add_argument("--base-port", type=int, default=0, metavar="P", help="listen on P, P+1, ... (default: any)")
    swarm.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    _add_quant(swarm)
    swarm.add_argument("--heartbeat", type=float, default=1.0, metavar="S", help=argparse.SUPPRESS)
    swarm.add_argument("--json", action="store_true", help="print each line as a JSON object (for scripts)")
    swarm.set_defaults(func=cmd_swarm)

    chat = sub.add_parser("chat", help="generate text through a swarm")
    chat.add_argument("--join", action="append", default=[], metavar="MULTIADDR|URL", help="the swarm to use")
    chat.add_argument("--model", default=None, help="must match the swarm's model (default: the swarm's)")
    chat.add_argument("--prompt", default=None, help="generate once for TEXT (default: the chat app)")
    _add_sampling(chat)
    _add_spec(chat)
    _add_audit(chat)
    chat.add_argument("--client-hops", action="store_true",
                      help="route every stage's output back through this machine (for comparison)")
    chat.add_argument("--micro-batches", type=int, default=None, metavar="M",
                      help="cut the prompt into M chunks that pipeline across stages (default: the plan's)")
    chat.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    chat.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    chat.add_argument("--swarm-secret-env", default=None, metavar="NAME")
    chat.add_argument("--heartbeat", type=float, default=3.0, metavar="S", help=argparse.SUPPRESS)
    chat.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_entry_addrs(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible API (/v1/chat/completions) over a swarm")
    serve.add_argument("--join", action="append", default=[], metavar="MULTIADDR|URL", help="the swarm to serve")
    serve.add_argument("--model", default=None, help="must match the swarm's model (default: the swarm's)")
    _add_serve(serve)
    _add_spec(serve)
    _add_audit(serve)
    serve.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    serve.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    serve.add_argument("--swarm-secret-env", default=None, metavar="NAME")
    serve.add_argument("--heartbeat", type=float, default=3.0, metavar="S", help=argparse.SUPPRESS)
    serve.add_argument("--json", action="store_true", help="print the serving line as a JSON object")
    _add_entry_addrs(serve)
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="the swarm at a glance: members, layer coverage, coordinator, plans")
    status.add_argument("--join", action="append", default=[], metavar="MULTIADDR|URL", help="the swarm to look at")
    status.add_argument("--json", action="store_true", help="print one JSON object (a line each with --watch)")
    status.add_argument("--watch", action="store_true", help="report again every few seconds until Ctrl-C")
    status.add_argument("--wait", type=float, default=8.0, metavar="S",
                        help="listen at most S seconds for the coordinator's plan before the first report")
    status.add_argument("--every", type=float, default=3.0, metavar="S", help="--watch: seconds between reports")
    status.add_argument("--swarm-secret-env", default=None, metavar="NAME")
    status.add_argument("--heartbeat", type=float, default=3.0, metavar="S", help=argparse.SUPPRESS)
    status.set_defaults(func=cmd_status)

    plan = sub.add_parser("plan", help="plan who hosts which layers for a cluster described in JSON")
    plan.add_argument("--cluster", required=True, metavar="FILE", help="cluster JSON (see DESIGN.md), - for stdin")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=cmd_plan)

    contrib = sub.add_parser("contribute", help="serve layers of the swarm's model with this machine")
    contrib.add_argument("--headless", action="store_true",
                         help="log to stderr, no dashboard (chosen by itself without a terminal)")
    contrib.add_argument("--json-events", action="store_true",
                         help="headless: print events (peer, addr, serving, ...) as one JSON object a line")
    contrib.add_argument("--model", default=None, help="built-in name, folder or hub id (default: the swarm's)")
    contrib.add_argument("--join", action="append", default=[], metavar="MULTIADDR|URL",
                         help="a peer's multiaddr or a swarm descriptor URL (none: start a new swarm)")
    contrib.add_argument("--listen", action="append", default=[], metavar="MULTIADDR")
    contrib.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                         help="the address peers should dial (behind port forwarding)")
    contrib.add_argument("--relay", action="append", default=[], metavar="MULTIADDR",
                         help="reserve a slot on this relay when peers cannot dial this machine")
    contrib.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    contrib.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    _add_quant(contrib, default=None)
    contrib.add_argument("--max-memory", type=int, default=None, metavar="BYTES", help="memory to offer the swarm")
    contrib.add_argument("--swarm-secret-env", default=None, metavar="NAME",
                         help="read the private-swarm secret from this environment variable")
    contrib.add_argument("--heartbeat", type=float, default=3.0, metavar="S", help=argparse.SUPPRESS)
    contrib.set_defaults(func=cmd_contribute)

    bench = sub.add_parser("bench", help="measure this machine's speed and memory for a model's layers")
    bench.add_argument("--model", default="tinycode", help="built-in name, checkpoint folder or hub id")
    bench.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    bench.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    _add_quant(bench)
    bench.add_argument("--refresh", action="store_true", help="measure again instead of using the cache")
    bench.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    bench.set_defaults(func=cmd_bench)

    ident = sub.add_parser("identity", help="this node's peer id and key, and the swarm secret")
    ident_sub = ident.add_subparsers(dest="action", metavar="ACTION")
    ident_sub.required = True
    ident_sub.add_parser("show", help="print the peer id and where the key and secret live")
    reset = ident_sub.add_parser("reset", help="make a new key (the peer id changes)")
    reset.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    secret = ident_sub.add_parser("secret", help="set the private-swarm secret (read from the terminal or stdin)")
    group = secret.add_mutually_exclusive_group(required=True)
    group.add_argument("--set", action="store_true", help="store a new secret")
    group.add_argument("--clear", action="store_true", help="forget the stored secret")
    ident.set_defaults(func=cmd_identity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from beeswarm.p2p import logs

    logs.setup(args.log_level)  # py-libp2p's records too: one line each, repeats summarised
    from beeswarm.shard.errors import ShardError

    try:
        return args.func(args)
    except (UserError, ShardError) as e:
        print(f"beeswarm: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # NodeFailed, the p2p node stopped on an error: exit 1, so a supervisor sees it
        errors = sys.modules.get("beeswarm.p2p.errors")  # not imported here: most commands never load py-libp2p
        if errors is None or not isinstance(e, errors.NodeFailed):
            raise
        print(f"beeswarm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
