"""Figures as people read them: sizes in B/KiB/MiB/GiB, optional numbers as '-'."""
from __future__ import annotations

from beeswarm.protocol.spans import Span


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def span(layers: Span | None) -> str:
    return "-" if layers is None else str(layers)
