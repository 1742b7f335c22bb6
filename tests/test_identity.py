"""`beeswarm identity`: a stable peer id, stored safely, with clear errors."""
from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys

import pytest

from beeswarm import secrets
from beeswarm.p2p import identity

pytestmark = pytest.mark.slow  # starts beeswarm processes: not in `make test-fast`


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BEESWARM_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.fail.Keyring")  # headless: no keyring
    monkeypatch.delenv("BEESWARM_IDENTITY", raising=False)
    monkeypatch.delenv("BEESWARM_SWARM_SECRET", raising=False)
    return tmp_path


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "beeswarm", "identity", *args], input=stdin, capture_output=True,
                          text=True, timeout=60, env=os.environ.copy())


def test_identity_is_created_once_and_reused(config_dir):
    first = identity.load_or_create()
    assert identity.load_or_create().peer_id == first.peer_id
    key = config_dir / "identity.secret"
    assert first.location == str(key)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_environment_key_overrides_and_bad_values_are_explained(config_dir, monkeypatch):
    stored = identity.load_or_create()
    other = identity.ephemeral()
    monkeypatch.setenv("BEESWARM_IDENTITY", base64.b64encode(other.key_pair.private_key.to_bytes()).decode())
    assert identity.load_or_create().peer_id == other.peer_id != stored.peer_id
    monkeypatch.setenv("BEESWARM_IDENTITY", "not base64!")
    with pytest.raises(secrets.SecretError, match="BEESWARM_IDENTITY"):
        identity.load_or_create()


def test_identity_cli_show_reset_and_secret(config_dir):
    shown = cli("show")
    assert shown.returncode == 0, shown.stderr
    peer = shown.stdout.split()[2]
    assert peer.startswith("12D3KooW") and str(config_dir) in shown.stdout
    assert cli("show").stdout.split()[2] == peer  # stable across runs

    refused = cli("reset")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert cli("show").stdout.split()[2] == peer

    reset = cli("reset", "--yes")
    assert reset.returncode == 0 and peer not in reset.stdout
    assert cli("show").stdout.split()[2] != peer

    assert cli("secret", "--set", stdin="short\n").returncode == 2
    assert cli("secret", "--set", stdin="a long enough secret\n").returncode == 0
    assert secrets.load("swarm-secret").value == b"a long enough secret"
    assert "swarm-secret.secret" in cli("show").stdout
    assert cli("secret", "--clear").returncode == 0
    assert secrets.load("swarm-secret") is None
