"""The `beeswarm` commands, one module each: `add_parser(subparsers)` adds the command's parser (its `func` is
the module's `run(args)`, which returns the exit status). Only `beeswarm.cli` imports this package; the modules
import what a command runs (torch, py-libp2p, Textual...) inside `run`, so that parsing and --help stay fast."""
from __future__ import annotations

from beeswarm.commands import bench, chat, contribute, credits, demo, identity, plan, serve, status, swarm

# the order --help lists them in
COMMANDS = (demo, swarm, chat, serve, status, credits, plan, contribute, bench, identity)


def add_parsers(sub) -> None:
    for command in COMMANDS:
        command.add_parser(sub)
