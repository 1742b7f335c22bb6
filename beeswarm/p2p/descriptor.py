"""How a volunteer joins from a link: `--join` takes multiaddrs or the URL of a swarm descriptor.

A descriptor is JSON: {"name", "model", "bootstrap": [multiaddr, ...], "private": bool, "quant": format}.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from beeswarm.protocol.membership import QUANT_FORMATS, Quant

RETRIES = 3
TIMEOUT_S = 10.0
MAX_BYTES = 1 << 20


class DescriptorError(Exception):
    """The descriptor could not be fetched or is not valid; the message says which."""


@dataclass(frozen=True)
class SwarmDescriptor:
    name: str
    model: str
    bootstrap: tuple[str, ...]
    private: bool = False
    quant: Quant = "none"  # the format of the weights every contributor serves

    def to_json(self) -> dict:
        return {"name": self.name, "model": self.model, "bootstrap": list(self.bootstrap), "private": self.private,
                "quant": self.quant}


def parse(data: object, where: str) -> SwarmDescriptor:
    if not isinstance(data, dict):
        raise DescriptorError(f"{where}: expected a JSON object")
    for key, kind in (("name", str), ("model", str), ("bootstrap", list)):
        if not isinstance(data.get(key), kind):
            raise DescriptorError(f"{where}: field {key!r} is missing or not a {kind.__name__}")
    if not data["bootstrap"] or not all(isinstance(a, str) and a.startswith("/") for a in data["bootstrap"]):
        raise DescriptorError(f"{where}: 'bootstrap' must list multiaddrs")
    quant = data.get("quant", "none")
    if quant not in QUANT_FORMATS:
        raise DescriptorError(f"{where}: 'quant' must be one of {', '.join(QUANT_FORMATS)}")
    return SwarmDescriptor(data["name"], data["model"], tuple(data["bootstrap"]), bool(data.get("private", False)),
                           quant)


def fetch(url: str, retries: int = RETRIES) -> SwarmDescriptor:
    last = ""
    for attempt in range(retries):
        try:
            with httpx.Client(timeout=TIMEOUT_S, follow_redirects=True) as client:
                response = client.get(url)
            if response.status_code != 200:
                raise DescriptorError(f"{url}: HTTP {response.status_code}")
            if len(response.content) > MAX_BYTES:
                raise DescriptorError(f"{url}: descriptor larger than {MAX_BYTES} bytes")
            try:
                data = response.json()
            except ValueError:
                raise DescriptorError(f"{url}: body is not JSON") from None
            return parse(data, url)
        except httpx.InvalidURL as e:
            raise DescriptorError(f"{url}: not a valid URL ({e})") from None
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
            time.sleep(0.5 * (attempt + 1))
        except DescriptorError as e:
            if "HTTP 5" not in str(e):
                raise
            last = str(e)
            time.sleep(0.5 * (attempt + 1))
    raise DescriptorError(f"{url}: could not fetch the swarm descriptor after {retries} tries ({last})")


def resolve_join(join: list[str]) -> tuple[list[str], SwarmDescriptor | None]:
    """Bootstrap multiaddrs from `--join` values (multiaddrs, or one http(s) descriptor URL)."""
    addrs: list[str] = []
    descriptor: SwarmDescriptor | None = None
    for value in join:
        if value.startswith(("http://", "https://")):
            descriptor = fetch(value)
            addrs.extend(descriptor.bootstrap)
        elif value.startswith("/"):
            addrs.append(value)
        else:
            raise DescriptorError(f"--join {value!r}: expected a multiaddr (/ip4/...) or an http(s):// URL")
    return addrs, descriptor


def write(descriptor: SwarmDescriptor, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(descriptor.to_json(), indent=2) + "\n")
    return path
