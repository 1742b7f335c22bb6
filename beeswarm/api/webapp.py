"""The web app `serve` ships at `/`: chat, and the swarm at a glance, for people who do not live in a terminal.

Plain HTML, CSS and JavaScript in `api/static/` (nothing to build, nothing fetched from elsewhere: it works
offline and from the bundle). The page chats through `/v1/chat/completions` like any OpenAI client and
reads two routes of its own: `/api/config` (the model, its sampling defaults, whether a key is needed) and
`/api/swarm` (what `status --json` prints, as this entry hears the swarm; the page polls it).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from beeswarm import __version__
from beeswarm.api.engine import Completer
from beeswarm.client.status import observe

STATIC = Path(__file__).parent / "static"
MAX_TOKENS_DEFAULT = 256  # the page's default reply length (the API's own default is the whole context)
NO_CACHE = {"Cache-Control": "no-cache"}  # a browser revalidates, so an upgraded server serves its own page


class WebApp:
    def __init__(self, completer: Completer, key_required: bool, authorize: Callable[[Request], Response | None]):
        """`authorize(request)`: None when the request may read the swarm, else the error response to send."""
        self.completer, self.key_required, self.authorize = completer, key_required, authorize

    def routes(self) -> list[BaseRoute]:
        return [Route("/", self.index), Route("/api/config", self.config), Route("/api/swarm", self.swarm),
                Mount("/static", StaticFiles(directory=STATIC), name="static")]

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=NO_CACHE)

    async def config(self, request: Request) -> Response:
        """What the page needs before the first message; no secret in it, so no key asked."""
        d = self.completer.defaults
        return JSONResponse({
            "model": self.completer.model_id, "version": __version__, "context": self.completer.context,
            "key_required": self.key_required,
            "defaults": {"temperature": 1.0 if d.temperature is None else d.temperature,
                         "top_p": 1.0 if d.top_p is None else d.top_p,
                         "repetition_penalty": 1.0 if d.repetition_penalty is None else d.repetition_penalty,
                         "max_tokens": min(MAX_TOKENS_DEFAULT, self.completer.context - 1)}})

    async def swarm(self, request: Request) -> Response:
        """`status --json`'s object as this entry hears the swarm, with the entry itself and the time."""
        refused = self.authorize(request)
        if refused is not None:
            return refused
        client = self.completer.client
        report = observe(client.members, client.coordinator)
        return JSONResponse({**report.as_json(), "model": self.completer.model_id, "time": time.time(),
                             "entry": {"peer": client.node.peer_id, "reach": client.node.reachability.reach,
                                       "audits": client.audits.as_json()}}, headers=NO_CACHE)
