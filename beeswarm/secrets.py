"""Small secrets (the node key, the swarm secret) in the OS keyring, with fallbacks.

Lookup order: the environment variable (base64; an explicit override wins), then the keyring,
then a 0600 file in the config dir. Storing tries the keyring and falls back to the file: headless
Linux has no keyring backend and raises NoKeyringError on read and write alike.
"""
from __future__ import annotations

import base64
import binascii
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from beeswarm.config import APP, config_dir

log = logging.getLogger(__name__)


class SecretError(Exception):
    """A stored secret exists but cannot be read (bad base64, unreadable file)."""


@dataclass(frozen=True)
class Secret:
    value: bytes
    location: str  # where it lives, for `beeswarm identity show`


def _keyring():
    try:
        import keyring

        return keyring
    except Exception:  # noqa: BLE001 - a broken keyring install must not stop the node
        return None


def _file(name: str) -> Path:
    return config_dir() / f"{name}.secret"


def _decode(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SecretError(f"{where}: not valid base64") from None


def load(name: str, env_var: str | None = None) -> Secret | None:
    if env_var and os.environ.get(env_var):
        return Secret(_decode(os.environ[env_var], f"${env_var}"), f"environment variable {env_var}")
    kr = _keyring()
    if kr is not None:
        try:
            stored = kr.get_password(APP, name)
        except Exception as e:  # noqa: BLE001 - NoKeyringError and backend failures alike
            log.debug("keyring unavailable for %s: %s", name, e)
        else:
            if stored:
                return Secret(_decode(stored, f"keyring {APP}/{name}"), f"keyring ({APP}/{name})")
    path = _file(name)
    if path.exists():
        try:
            return Secret(_decode(path.read_text(), str(path)), str(path))
        except OSError as e:
            raise SecretError(f"{path}: {e}") from None
    return None


def store(name: str, value: bytes) -> str:
    """Save `value`; returns where it went."""
    text = base64.b64encode(value).decode()
    kr = _keyring()
    if kr is not None:
        try:
            kr.set_password(APP, name, text)
            return f"keyring ({APP}/{name})"
        except Exception as e:  # noqa: BLE001
            log.debug("keyring refused %s (%s); using a file", name, e)
    path = _file(name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic: a crash never leaves half a key
    return str(path)


def delete(name: str) -> None:
    kr = _keyring()
    if kr is not None:
        try:
            kr.delete_password(APP, name)
        except Exception:  # noqa: BLE001 - absent or no backend
            pass
    _file(name).unlink(missing_ok=True)
