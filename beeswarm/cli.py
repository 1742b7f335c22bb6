"""The `beeswarm` command line: the parser, logging, and how errors become exit statuses. Each command is a
module of `beeswarm.commands`."""
from __future__ import annotations

import argparse
import os
import sys

import beeswarm
from beeswarm import commands
from beeswarm.commands.common import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="beeswarm",
                                     description="Run one large language model across volunteer machines.")
    parser.add_argument("--version", action="version", version=f"beeswarm {beeswarm.__version__}")
    parser.add_argument("--log-level", default=os.environ.get("BEESWARM_LOG_LEVEL", "WARNING"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log detail on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    commands.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from beeswarm import logs

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
