#!/usr/bin/env python3
"""The README's pictures of the web app: `demo --serve` on tinycode, one greedy reply, both views.

Drives Debian's Chromium (or the one at $CHROMIUM) with Playwright, as tests/test_web.py does, and
writes docs/web-chat.png and docs/web-swarm.png. About a minute on 2 cores.

    python scripts/web_screenshots.py [--out docs]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

PROMPT = "def fibonacci(n):"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    args = parser.parse_args()
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no Chromium: apt-get install chromium (or set CHROMIUM)")
    args.out.mkdir(parents=True, exist_ok=True)
    demo = subprocess.Popen([sys.executable, "-m", "beeswarm", "demo", "--serve", "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert demo.stdout is not None
        served = next(json.loads(line) for line in demo.stdout if line.startswith('{"event": "serving"'))
        root = served["url"].removesuffix("/v1")
        deadline = time.monotonic() + 120
        while httpx.get(root + "/health").status_code != 200:
            if time.monotonic() > deadline:
                sys.exit("the demo swarm found no route in 2 minutes")
            time.sleep(1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 1100, "height": 640})
            page.goto(root + "/")
            page.get_by_label("Temperature").fill("0")
            page.get_by_label("Max tokens").fill("64")
            page.get_by_label("Message").fill(PROMPT)
            page.get_by_label("Message").press("Enter")
            page.locator("#messages li.assistant[data-done='true']").wait_for(timeout=120_000)
            page.screenshot(path=args.out / "web-chat.png")
            page.get_by_role("tab", name="Swarm").click()
            time.sleep(10)  # a few refreshes: the sparklines fill in
            page.screenshot(path=args.out / "web-swarm.png", full_page=True)
            browser.close()
    finally:
        demo.send_signal(signal.SIGTERM)
        demo.wait(60)
    print(f"wrote {args.out / 'web-chat.png'} and {args.out / 'web-swarm.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
