"""Option groups more than one command takes, each defined once (flags, defaults and help as users know them)."""
from __future__ import annotations

import argparse

from beeswarm.protocol.membership import QUANT_FORMATS

QUANT_HELP = ("the weights' format every contributor serves: none (the checkpoint's), int8 (weight-only, "
              "per-channel scales; CPU and CUDA) or nf4 (4-bit; meant for CUDA)")


def add_device(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """--device, and --dtype unless the command runs no model in this process."""
    p.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    if dtype:
        p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")


def add_quant(p: argparse.ArgumentParser, default: str | None = "none") -> None:
    p.add_argument("--quant", choices=QUANT_FORMATS, default=default,
                   help=QUANT_HELP + (f" (default: {default})" if default else " (default: the swarm's, else none)"))


def add_join(p: argparse.ArgumentParser, what: str) -> None:
    """--join, and the relays a node behind a NAT may be reached through."""
    p.add_argument("--join", action="append", default=[], metavar="MULTIADDR|URL", help=what)
    add_relay(p)


def add_relay(p: argparse.ArgumentParser) -> None:
    p.add_argument("--relay", action="append", default=[], metavar="MULTIADDR",
                   help="always hold a slot on this relay (a node peers cannot dial takes two slots on the swarm's "
                        "public members by itself)")


def add_entry_addrs(p: argparse.ArgumentParser) -> None:
    """Where an entry's node listens and what it announces."""
    p.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                   help="where this entry's node listens (stages connect back to it)")
    p.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="an address peers should dial (a port-forward or a public address)")


def add_payer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--identity", choices=("ephemeral", "machine"), default="ephemeral",
                   help="whose credit generating spends: a fresh identity's free allowance (default), or this "
                        "machine's key, the one `contribute` earns with")


def add_contributor_addrs(p: argparse.ArgumentParser) -> None:
    """Where a contributor's node listens, what it announces, and whether it relays for others."""
    p.add_argument("--listen", action="append", default=[], metavar="MULTIADDR")
    p.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="the address peers should dial (behind port forwarding)")
    p.add_argument("--no-relay-service", action="store_true",
                   help="never relay circuits for members behind NATs (by default a contributor others can dial "
                        "does, within limits per circuit and per relay)")


def add_secret(p: argparse.ArgumentParser, what: str | None = None) -> None:
    p.add_argument("--swarm-secret-env", default=None, metavar="NAME", help=what)


def add_heartbeat(p: argparse.ArgumentParser, default: float = 3.0) -> None:
    p.add_argument("--heartbeat", type=float, default=default, metavar="S", help=argparse.SUPPRESS)


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (default: sample)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="default: the model's generation config, else 0.8")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="default: the model's, else 0.95")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="above 1 makes tokens already in the text less likely, greedy too (default: the model's, "
                        "else 1: none)")
    p.add_argument("--seed", type=int, default=None, metavar="S")


def add_spec(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-spec", action="store_true", help="no speculative decoding (same as --draft none)")
    p.add_argument("--draft", default=None, metavar="REF",
                   help="draft model sharing the target's tokenizer (default: the model's paired draft; none: off)")
    p.add_argument("--spec-depth", default="auto", metavar="K|auto", help="draft tree depth (default: tuned)")
    p.add_argument("--spec-width", default="auto", metavar="W|auto",
                   help="children per tree node, 1 for a chain (default: tuned)")
    p.add_argument("--spec-in-flight", default="auto", metavar="D|auto",
                   help="speculative steps kept in flight around the ring, 1 for serial rounds (default: tuned, "
                        "pipelined only where it measures faster)")


def _audit_rate(text: str) -> float:  # argparse names the function in its error ("invalid _audit_rate value")
    rate = float(text)
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a probability between 0 and 1")
    return rate


def add_audit(p: argparse.ArgumentParser) -> None:
    from beeswarm.audit import DEFAULT_RATE

    p.add_argument("--audit-rate", type=_audit_rate, default=DEFAULT_RATE, metavar="P",
                   help=f"check each stage's steps with probability P (default {DEFAULT_RATE}; 0: off); other "
                        "contributors recompute them, so this machine needs no layers")
    p.add_argument("--audit-here", action="store_true",
                   help="recompute audits on this machine instead (it loads every span it audits, once)")


def add_serve(p: argparse.ArgumentParser) -> None:
    """The HTTP server of the OpenAI-compatible API."""
    p.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one)")
    p.add_argument("--api-key-env", default=None, metavar="NAME",
                   help="require `Authorization: Bearer KEY`, KEY read from environment variable NAME")
    p.add_argument("--max-concurrent", type=int, default=8, metavar="N",
                   help="requests generated at once; more get 429 (default: 8)")
