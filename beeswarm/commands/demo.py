"""`beeswarm demo`: a real local swarm of 3 contributor processes plus this process as the entry; stopped after."""
from __future__ import annotations

import argparse
import sys

from beeswarm.commands import options
from beeswarm.commands.chat import chat_app, run_chat
from beeswarm.commands.common import UserError, interactive
from beeswarm.commands.entry import chat_common, encode_prompt, speculation, start_client
from beeswarm.commands.serve import api_key, serve_api


def add_parser(sub) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="start a local swarm of 3 contributor processes and generate through it")
    demo.add_argument("--model", default="tinycode", help="built-in name, checkpoint folder or hub id (org/name)")
    demo.add_argument("--prompt", default=None, help="generate once for TEXT (default: the chat app)")
    options.add_sampling(demo)
    options.add_spec(demo)
    options.add_audit(demo)
    options.add_device(demo)
    options.add_quant(demo)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    demo.add_argument("--serve", action="store_true", help="serve the OpenAI-compatible API instead of chatting")
    options.add_serve(demo)
    options.add_payer(demo)
    options.add_entry_addrs(demo)
    options.add_relay(demo)
    demo.set_defaults(func=run, client_hops=False, heartbeat=1.0)
    return demo


def run(args) -> int:
    """A real local swarm of 3 contributor processes plus this process as the entry; stopped after."""
    import torch

    from beeswarm.contributor.local_swarm import ChildFlags, LocalSwarm, LocalSwarmError, threads_per_process

    params, entry = chat_common(args)
    if args.serve:
        key = api_key(args.api_key_env)  # a missing key fails before any process starts
    elif args.prompt is not None:
        encode_prompt(entry, args)  # fail on a bad prompt before starting anything
    elif not interactive():
        raise UserError("give --prompt TEXT or --serve (the chat app needs a terminal)")
    draft, tuner = speculation(args, entry)  # a bad flag fails before any process starts
    stages = min(3, entry.config.num_hidden_layers)
    swarm = LocalSwarm(stages, args.model, flags=ChildFlags(device=args.device, quant=args.quant))
    torch.set_num_threads(threads_per_process(stages + 1))  # the entry shares the cores with the stages
    client = None
    try:
        print(f"starting a local swarm of {stages} contributors for {args.model} "
              f"(logs in {swarm.state_dir})...", file=sys.stderr, flush=True)
        bootstrap = swarm.start()
        swarm.wait_ready()
        # no secret: the local swarm is open; --heartbeat is not a demo flag: args.heartbeat is 1.0, as the swarm's
        client = start_client(args, entry, [bootstrap], draft, tuner, listen=["/ip4/127.0.0.1/tcp/0"])
        if args.serve:
            return serve_api(client, entry, args, key)
        if args.prompt is not None:
            return run_chat(client, entry, args, params)
        return chat_app(client, entry, args, params, side_panel=True)
    except LocalSwarmError as e:
        raise UserError(str(e)) from None
    finally:
        if client is not None:
            client.close()
        swarm.stop()
