"""The control API and the status page: one HTTP server (Starlette on uvicorn), one token.

Every route but the login page needs the control token: API clients send
``Authorization: Bearer TOKEN``; a browser posts the token once to
``/login`` and gets it back as an HttpOnly, SameSite=Strict cookie, which
is accepted for reading (GET) only, so no page on another site can submit or
stop a run through a visitor's browser. Tokens are compared in constant
time. The server listens on loopback unless ``[serve]`` gives it TLS
(:mod:`meshkit.service._config` refuses anything else).

======================================  ======================================
``GET /api/runs``                       every run (``meshkit ls``)
``POST /api/runs``                      submit ``{name, config, authorized}``
``GET /api/runs/RUN``                   one run and its latest round
``GET /api/runs/RUN/events?after=N``    its events after N (``&wait=S``
                                        waits up to S s for one: ``--follow``)
``POST /api/runs/RUN/stop``             stop it (``meshkit stop``)
``GET /api/nodes``                      the node registry and who is connected
``GET /``                               the status page (``/static/*``)
======================================  ======================================
"""

from __future__ import annotations

import hmac

import logging
import socket
import threading
import urllib.parse
from importlib import resources
from typing import Any, Awaitable, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from meshkit.errors import MeshError
from meshkit.service._store import UNFINISHED

__all__ = ["ControlServer", "COOKIE", "MAX_WAIT"]

log = logging.getLogger(__name__)

COOKIE = "meshkit_token"
#: The longest a ``?wait=`` long poll holds a request open.
MAX_WAIT = 30.0
_STATIC = {"app.js": "text/javascript", "plot.js": "text/javascript", "style.css": "text/css"}


def _app(service: Any) -> Starlette:
    token = service.token
    store = service.store
    secure = bool(service.config.tls_cert)

    def _authorized(request: Request) -> bool:
        header = request.headers.get("authorization", "")
        if header.startswith("Bearer "):
            return hmac.compare_digest(header[7:].strip().encode(), token)
        cookie = request.cookies.get(COOKIE)
        if cookie is not None and request.method == "GET":
            return hmac.compare_digest(cookie.encode(), token)
        return False

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
        async def wrapped(request: Request) -> Response:
            if not _authorized(request):
                return JSONResponse({"error": "unauthorized: send the control token (meshkit "
                                              "reads it from --token-file or STATE_DIR/"
                                              "control.token)"}, status_code=401)
            try:
                return await handler(request)
            except MeshError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
        return wrapped

    def page(name: str) -> str:
        return resources.files("meshkit.service").joinpath("static", name).read_text()

    async def index(request: Request) -> Response:
        if not _authorized(request):
            return HTMLResponse(page("login.html"), status_code=401)
        return HTMLResponse(page("index.html"))

    async def login(request: Request) -> Response:
        # Parsed here (a urlencoded form of one field), so no multipart library is needed.
        body = await request.body()
        fields = urllib.parse.parse_qs(body[:4096].decode(errors="replace"))
        given = (fields.get("token") or [""])[0].strip().encode()
        if not hmac.compare_digest(given, token):
            return HTMLResponse(page("login.html").replace("<!--error-->",
                                                           "<p class=error>wrong token</p>"),
                                status_code=401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, token.decode(), httponly=True, samesite="strict",
                            secure=secure)
        return response

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _STATIC or not _authorized(request):
            return Response("not found", status_code=404)
        return Response(page(name), media_type=_STATIC[name])

    async def runs(request: Request) -> Response:
        records = await run_in_threadpool(store.runs)
        return JSONResponse({"runs": [r.to_json() for r in records]})

    async def submit(request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("config"), str):
            return JSONResponse({"error": "expected {name, config, authorized}"}, status_code=400)
        record = await run_in_threadpool(service.submit, str(body.get("name") or "run.toml"),
                                         body["config"], body.get("authorized"))
        return JSONResponse({"run": record.to_json()}, status_code=201)

    def _record(run_id: str) -> Any:
        record = store.run(run_id)
        if record is None:
            raise MeshError(f"no run {run_id!r} (see `meshkit ls`)")
        return record

    async def status(request: Request) -> Response:
        run_id = request.path_params["run"]
        record = await run_in_threadpool(_record, run_id)
        rounds = await run_in_threadpool(store.events, run_id, kinds=("round",))
        return JSONResponse({"run": record.to_json(config=True),
                             "latest": rounds[-1].data if rounds else None})

    async def events(request: Request) -> Response:
        run_id = request.path_params["run"]
        await run_in_threadpool(_record, run_id)
        try:
            after = int(request.query_params.get("after", "0"))
            wait = min(max(float(request.query_params.get("wait", "0")), 0.0), MAX_WAIT)
        except ValueError:
            return JSONResponse({"error": "after is an integer, wait a number of seconds"},
                                status_code=400)
        found = await run_in_threadpool(store.wait_events, run_id, after=after, timeout=wait)
        record = await run_in_threadpool(_record, run_id)
        return JSONResponse({"events": [e.to_json() for e in found], "state": record.state,
                             "finished": record.state not in UNFINISHED})

    async def stop(request: Request) -> Response:
        record = await run_in_threadpool(service.stop_run, request.path_params["run"])
        return JSONResponse({"run": record.to_json()})

    async def nodes(request: Request) -> Response:
        records = await run_in_threadpool(store.nodes)
        return JSONResponse({"nodes": [n.to_json() for n in records],
                             "address": service.node_address})

    return Starlette(routes=[
        Route("/", index),
        Route("/login", login, methods=["POST"]),
        Route("/static/{name}", static),
        Route("/api/runs", guarded(runs)),
        Route("/api/runs", guarded(submit), methods=["POST"]),
        Route("/api/runs/{run}", guarded(status)),
        Route("/api/runs/{run}/events", guarded(events)),
        Route("/api/runs/{run}/stop", guarded(stop), methods=["POST"]),
        Route("/api/nodes", guarded(nodes)),
    ])


class ControlServer:
    """uvicorn serving :func:`_app` on the service's bound control socket, in a thread."""

    def __init__(self, service: Any, sock: socket.socket) -> None:
        config = service.config
        self._server = uvicorn.Server(uvicorn.Config(
            _app(service), log_level="warning", lifespan="off", ws="none",
            ssl_certfile=config.tls_cert or None, ssl_keyfile=config.tls_key or None))
        self._sock = sock
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="meshkit-serve-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)


