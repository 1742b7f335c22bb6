"""The web app `serve` ships at `/`, in a real browser: Debian's Chromium, driven headless by Playwright.

One swarm for the module: three contributor processes that each hold a third of the model (so a killed
one leaves a gap nobody can fill) and a `serve` process in front of them with an API key. Screenshots of
each view go to build/test-artifacts/ (BEESWARM_TEST_ARTIFACTS elsewhere): look at them.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from beeswarm.contributor.local_swarm import budgets
from helpers import past_probation, serve, start_contributors, wait_for

pytestmark = pytest.mark.slow  # starts beeswarm processes: not in `make test-fast`

KEY = "web-key-0123"
PROMPT = "def f(x):"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("BEESWARM_TEST_ARTIFACTS", Path(__file__).parent.parent / "build" / "test-artifacts"))


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium here: `make test` installs Debian's (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is a test extra: pip install -e .[test]")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def swarm(tiny_models, tmp_path_factory):
    model = str(tiny_models["llama"])
    tmp = tmp_path_factory.mktemp("web")
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp / "cache"), "PYTHONUNBUFFERED": "1", "API_KEY": KEY}
    env.pop("BEESWARM_IDENTITY", None)
    procs: list = []
    try:
        peers, boot = start_contributors(procs, model, 3, max(budgets(model, 3)), env, tmp)
        with open(tmp / "serve.log", "w") as log:
            proc, url = serve(model, boot, env, log, "--api-key-env", "API_KEY")
        procs.append(proc)
        root = url.removesuffix("/v1")
        http = httpx.Client(base_url=root, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
        wait_for(lambda: http.get("/health").json()["status"] == "ok", 90, "a route through the swarm")
        yield root, http, model, peers
    finally:
        for p in procs:
            p.kill()
            p.wait()


def api_greedy(http: httpx.Client, model: str, messages: list[dict], n: int) -> str:
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0}
    return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def test_the_chat_asks_for_the_key_then_streams_the_apis_greedy_reply_and_stops_when_told(browser, swarm):
    root, http, model, _ = swarm
    page = browser.new_page()
    page.goto(root + "/")
    page.get_by_label("This server needs its API key").wait_for()
    assert page.get_by_role("tab", name="Chat").get_attribute("aria-selected") == "true"

    # Without the key: a sentence that says what to do, and the question back in the box.
    page.get_by_label("Message").fill(PROMPT)
    page.get_by_label("Message").press("Enter")
    error = page.locator("#messages li.error")
    error.wait_for()
    assert error.locator(".content").text_content() == \
        "This server needs its API key: enter it above, then send again."
    assert page.get_by_label("Message").input_value() == PROMPT

    page.get_by_label("This server needs its API key").fill(KEY)
    page.get_by_role("button", name="Use key").click()
    page.locator("#key-form").wait_for(state="hidden")

    # The model's defaults are shown and editable; greedy here, so the page's reply is the API's.
    assert float(page.get_by_label("Temperature").input_value()) >= 0
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("12")
    page.get_by_label("Message").press("Enter")  # the question the error put back
    reply = page.locator("#messages li.assistant[data-done='true']")
    reply.wait_for(timeout=60_000)
    expected = api_greedy(http, model, [{"role": "user", "content": PROMPT}], 12)
    assert reply.locator(".content").text_content() == expected
    meta = reply.locator(".meta").text_content()
    assert "12 tokens" in meta and "tokens/s" in meta and "first token" in meta and "route " in meta, meta
    page.screenshot(path=ARTIFACTS / "web-chat.png", full_page=True)

    # A second turn carries the first; a long reply stops on Escape, keeping what came (it streams as it goes
    # once the route's stages are past probation).
    wait_for(lambda: past_probation(lambda: http.get("/health").json(), lambda: api_greedy(
        http, model, [{"role": "user", "content": PROMPT}], 4)), 120, "a route past probation")
    page.get_by_label("Max tokens").fill("400")  # of the tiny model's 512-token context
    page.get_by_label("Message").fill("and again")
    page.get_by_label("Message").press("Enter")
    try:
        page.locator("#messages li.streaming .content:not(:empty)").wait_for(timeout=60_000)
    except Exception:
        page.screenshot(path=ARTIFACTS / "web-chat-failed.png", full_page=True)
        shown = page.locator("#messages").inner_text()
        raise AssertionError(f"no reply streaming; the conversation: {shown}") from None
    page.keyboard.press("Escape")
    stopped = page.locator("#messages li.assistant[data-done='stopped']")
    stopped.wait_for(timeout=10_000)
    assert stopped.locator(".meta").text_content() == "stopped"
    assert page.get_by_role("button", name="Send").is_enabled()
    wait_for(lambda: http.get("/health").json()["active_requests"] == 0, 15, "the stopped generation to end")

    page.get_by_role("button", name="New chat").click()
    assert page.locator("#messages li").count() == 0
    page.close()


def test_the_swarm_view_shows_the_contributors_and_a_killed_one_gone_with_its_gap_without_a_reload(browser, swarm):
    root, _, _, peers = swarm
    page = browser.new_page()
    page.add_init_script(f"sessionStorage.setItem('beeswarm.key', '{KEY}')")  # the key given once, earlier
    page.goto(root + "/#swarm")
    assert page.get_by_role("tab", name="Swarm").get_attribute("aria-selected") == "true"
    rows = page.locator("#members tbody tr[data-state='serving']")
    wait_for(lambda: rows.count() == 3 and page.locator("#swarm-summary[data-complete='true']").count() == 1, 30,
             "three serving contributors and full coverage in the page")
    assert sorted(rows.evaluate_all("rows => rows.map(r => r.dataset.peer)")) == sorted(peers)
    assert page.locator("#layers .seg.gap").count() == 0
    assert page.locator("#members tbody tr", has_text="★").count() == 1  # the coordinator
    page.screenshot(path=ARTIFACTS / "web-swarm.png", full_page=True)

    page.evaluate("window.stillTheSamePage = true")
    victim, proc = sorted(peers.items())[1]
    proc.kill()
    t0 = time.monotonic()
    page.locator(f"#members tbody tr[data-peer='{victim}'][data-state='gone']").wait_for(timeout=30_000)
    page.locator("#layers .seg.gap").first.wait_for(timeout=30_000)
    seen_after = time.monotonic() - t0
    assert page.evaluate("window.stillTheSamePage") is True  # live, no reload
    assert page.locator("#swarm-summary[data-complete='false']").count() == 1
    assert "unserved" in page.locator("#swarm-summary").text_content()
    print(f"the page showed the killed contributor gone and its gap {seen_after:.1f} s after kill -9")
    page.screenshot(path=ARTIFACTS / "web-swarm-after-kill.png", full_page=True)

    # Narrow and dark: the same views stay readable (looked at by a person, not asserted pixel by pixel).
    page.set_viewport_size({"width": 390, "height": 844})
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=ARTIFACTS / "web-swarm-narrow-dark.png", full_page=True)
    page.get_by_role("tab", name="Swarm").press("ArrowLeft")  # the tabs work from the keyboard
    assert page.get_by_role("tab", name="Chat").get_attribute("aria-selected") == "true"
    page.screenshot(path=ARTIFACTS / "web-chat-narrow-dark.png", full_page=True)
    page.close()
