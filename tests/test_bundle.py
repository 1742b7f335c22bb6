"""The PyInstaller bundle, run as a volunteer without Python would run it.

`make test` builds it first (`make bundle`) and sets BEESWARM_REQUIRE_BUNDLE, so there a missing
bundle fails; a bare `pytest` skips these tests until `make bundle` has been run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import alive, in_terminal, lines_of, read_until, wait_for

BUNDLE = Path(os.environ.get("BEESWARM_BUNDLE", Path(__file__).parent.parent / "dist" / "beeswarm" / "beeswarm"))
pytestmark = pytest.mark.skipif(not BUNDLE.exists() and not os.environ.get("BEESWARM_REQUIRE_BUNDLE"),
                                reason="no bundle: run `make bundle`")


@pytest.fixture
def env(tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "BEESWARM_"))}
    return {**e, "BEESWARM_CONFIG_DIR": str(tmp_path / "config"), "BEESWARM_CACHE_DIR": str(tmp_path / "cache"),
            "PATH": "/usr/bin:/bin"}  # nothing of the project's Python on the path


def run(env, *args, timeout=120):
    assert BUNDLE.exists(), f"{BUNDLE} is missing: run `make bundle`"
    return subprocess.run([str(BUNDLE), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_version(env):
    out = run(env, "--version", timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("beeswarm "), out.stderr


def test_demo_runs_a_local_swarm_from_the_bundle(env):
    out = run(env, "demo", "--prompt", "def ", "--max-new-tokens", "8", "--greedy", "--json", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert 1 <= result["new_tokens"] <= 8 and len(result["route"]) == 3
    assert result["rounds"] >= 1  # tinycode's draft ships in the bundle: speculation is on


def test_demo_serves_the_openai_api_from_the_bundle(env):
    import httpx

    demo = subprocess.Popen([str(BUNDLE), "demo", "--serve", "--port", "0", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line, _ = read_until(lines_of(demo), '{"event": "serving"', 240)
        url = json.loads(line)["url"]
        wait_for(lambda: httpx.get(url.removesuffix("/v1") + "/health").status_code == 200, 60, "a route")
        reply = httpx.post(url + "/chat/completions", timeout=120, json={
            "model": "tinycode", "messages": [{"role": "user", "content": "def "}], "max_tokens": 6,
            "temperature": 0}).json()
        assert reply["usage"]["completion_tokens"] >= 1 and reply["choices"][0]["message"]["content"]
        # the web app ships inside the bundle: its page, its script and style, and the swarm it shows
        root = url.removesuffix("/v1")
        page = httpx.get(root + "/")
        assert page.status_code == 200 and "<title>beeswarm</title>" in page.text
        for asset in ("/static/app.js", "/static/app.css"):
            assert httpx.get(root + asset).status_code == 200, asset
        assert httpx.get(root + "/api/config").json()["model"] == "tinycode"
        swarm = httpx.get(root + "/api/swarm").json()
        assert swarm["complete"] and sum(m["role"] == "contributor" for m in swarm["members"]) == 3
    finally:
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(30) == 0


def test_contribute_and_chat_start_headless_and_quit_cleanly(env, tmp_path):
    swarm = subprocess.Popen([str(BUNDLE), "swarm", "--local", "2", "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        _, seen = read_until(lines_of(swarm), '{"event": "ready"', 180)
        events = [json.loads(line) for line in seen]
        descriptor = next(e["path"] for e in events if e["event"] == "descriptor")
        pids = [e["pid"] for e in events if e["event"] == "contributor"]
        chat = run(env, "chat", "--join", json.load(open(descriptor))["bootstrap"][0], "--prompt", "import ",
                   "--max-new-tokens", "6", "--greedy", "--json", "--no-spec", timeout=180)
        assert chat.returncode == 0, chat.stderr[-3000:]
        assert json.loads(chat.stdout)["new_tokens"] >= 1
    finally:
        swarm.send_signal(signal.SIGTERM)
        assert swarm.wait(30) == 0
    wait_for(lambda: not any(alive(p) for p in pids), 15, "every contributor of the bundle to exit")


def test_chat_app_opens_in_a_terminal_and_quits(env):
    """The Textual app itself (its widgets load lazily: --help alone would not catch a missing one)."""
    from beeswarm.p2p import identity

    nowhere = f"/ip4/127.0.0.1/tcp/9/p2p/{identity.ephemeral().peer_id}"  # the app opens before any route
    code, _ = in_terminal([str(BUNDLE), "chat", "--join", nowhere, "--model", "tinycode", "--no-spec"], env,
                          b"Say something", b"\x11")  # (--model: without it chat asks the swarm for its model)
    assert code == 0  # Ctrl-Q


def test_contribute_dashboard_opens_in_a_terminal_and_leaves(env):
    code, screen = in_terminal([str(BUNDLE), "contribute", "--listen", "/ip4/127.0.0.1/tcp/0"], env, b"Re-benchmark",
                               b"q", timeout=180)
    assert code == 0 and b"start-up" in screen
