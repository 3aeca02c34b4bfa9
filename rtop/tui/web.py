"""``rtop --web``: the same UI in a browser, served by textual-serve.

textual-serve runs ``python -m rtop ARGS`` once per browser tab and streams the
terminal to the page. It listens on loopback only: the page gives whoever opens it the
same view as the terminal UI, so reach it over an SSH tunnel that keeps the port
(``ssh -L 8000:localhost:8000 host``: the page connects back to its websocket at that
port) rather than exposing it.

Loopback is not enough: any local user, and any web page in the user's browser, can
reach a loopback port. So every launch makes a random **key** and serves everything
under it: the page is ``http://127.0.0.1:PORT/KEY/``, printed once when the server
starts, and its WebSocket ``ws://127.0.0.1:PORT/KEY/ws``. A request whose path does not
start with the key (compared in constant time) gets ``403`` and nothing else: no page,
no script, no session. The WebSocket, which starts a session (an ``rtop`` that holds
the hub's token), also needs an ``Origin`` of this server's own page
(``http://127.0.0.1:PORT`` or ``http://localhost:PORT``): a page of another origin that
learnt the key, or a client that sends no ``Origin``, is refused with ``403`` before
any session starts. Refusals are logged (rate-limited, never with the key); the access
log, whose lines would carry the key, is off. textual-serve's file downloads are not
served (rtop delivers no files).

SIGINT and SIGTERM stop the server cleanly: each open tab's ``rtop`` is asked to quit,
and any that has not after a few seconds is terminated, so none outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import secrets
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rtop.web")

#: seconds each browser session's ``rtop`` gets to quit on shutdown before it is terminated
SESSION_GRACE_S = 5.0
#: random bytes of each launch's key (the key is their URL-safe base64: 43 characters)
KEY_BYTES = 32
#: refusals logged per ``REFUSAL_WINDOW_S``; the rest are counted, then summed up
REFUSALS_LOGGED = 5
REFUSAL_WINDOW_S = 10.0
#: characters of a refused request's Origin header that are logged
LOG_CHARS = 100

#: headers of every response that is not a WebSocket: the URL (the key) is not sent on
#: as a Referer, the page cannot be framed, and nothing is cached
SAFE_HEADERS = {"Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
                "Content-Security-Policy": "frame-ancestors 'none'",
                "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def web_command(argv: list[str]) -> str:
    """The shell command textual-serve runs for each browser session.

    ``exec`` makes the shell become ``rtop`` itself, so the server's children are the
    sessions and a signal to one reaches the app rather than a waiting shell.
    """
    return "exec " + " ".join(shlex.quote(a) for a in [sys.executable, "-m", "rtop", *argv])


def new_key() -> str:
    """A fresh random key for one launch (URL-safe: letters, digits, ``-`` and ``_``)."""
    return secrets.token_urlsafe(KEY_BYTES)


def origin_of(host: str, port: int) -> str:
    """The browser origin of ``http://HOST:PORT`` (an IPv6 HOST in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host.lower()}:{port}"


def allowed_origins(host: str, port: int) -> frozenset[str]:
    """The origins whose pages may open the WebSocket: this server's own page, by the
    address it listens on and by the loopback names a browser may use for it."""
    return frozenset({origin_of(host, port), origin_of("127.0.0.1", port),
                      origin_of("localhost", port)})


def page_url(host: str, port: int, key: str) -> str:
    """The address of the page: the one to open in a browser."""
    return f"{origin_of(host, port)}/{key}/"


def key_matches(path: str, key: str) -> bool:
    """Whether the raw URL PATH starts with the segment ``/KEY`` (constant-time)."""
    first = path.split("/", 2)[1] if path.startswith("/") else ""
    return hmac.compare_digest(first.encode("utf-8", "surrogateescape"), key.encode())


class RefusalLog:
    """Logs refusals, at most ``REFUSALS_LOGGED`` per ``REFUSAL_WINDOW_S``: a flood of
    refused requests cannot flood the log."""

    def __init__(self) -> None:
        self._window_start = -REFUSAL_WINDOW_S
        self._logged = 0
        self._suppressed = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window_start >= REFUSAL_WINDOW_S:
            if self._suppressed:
                log.warning("%d more refusals were not logged", self._suppressed)
            self._window_start, self._logged, self._suppressed = now, 0, 0
        if self._logged < REFUSALS_LOGGED:
            self._logged += 1
            log.warning(msg, *args)
        else:
            self._suppressed += 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on HOST that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _check_bindable(host: str, port: int) -> str | None:
    """None if HOST:PORT can be listened on, else why not (a short sentence)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # aiohttp binds with SO_REUSEADDR too: a port in TIME_WAIT is usable
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"port {port} is in use (choose another with --web-port)"
        return exc.strerror or str(exc)
    return None


def _make_server(command: str, host: str, port: int, key: str) -> Any:
    """A textual-serve Server that serves only under KEY, opens WebSockets only for its
    own origin, and ends its sessions' processes when it stops."""
    import aiohttp_jinja2
    import jinja2
    import psutil
    from aiohttp import web
    from textual_serve.server import Server, to_int

    class RtopServer(Server):
        """textual-serve's Server behind a key and an Origin check (see the module doc),
        plus a shutdown that leaves no session behind."""

        def __init__(self) -> None:
            super().__init__(command, host=host, port=port, title="rtop")
            self.public_url = origin_of(host, port)
            self.key = key
            self.origins = allowed_origins(host, port)
            self.refused = RefusalLog()
            self._sessions: set[asyncio.Task[Any]] = set()

        def initialize_logging(self) -> None:
            """Plain log lines on stderr (the CLI's, when it set logging up); no access
            log (its lines hold the URL, so the key) and no rich tracebacks with locals
            (a request's repr holds the URL too)."""
            logging.basicConfig(level=logging.INFO, format="rtop --web: %(message)s",
                                stream=sys.stderr)
            logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

        async def on_startup(self, app: web.Application) -> None:
            """Nothing printed: ``serve_web`` printed the page's address (with the key)."""

        async def _make_app(self) -> web.Application:
            """textual-serve's routes, every one under ``/{key}/``."""
            app = web.Application(middlewares=[self.guard])
            aiohttp_jinja2.setup(app, loader=jinja2.FileSystemLoader(self.templates_path))
            app.add_routes([
                web.get("/{key}", self.handle_root),
                web.get("/{key}/", self.handle_index),
                web.get("/{key}/ws", self.handle_websocket),
                web.get("/{key}/static/{path:.+}", self.handle_static),
            ])
            app.on_startup.append(self.on_startup)
            app.on_shutdown.append(self.on_shutdown)
            return app

        @web.middleware
        async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
            """403 for any request whose path does not start with the key."""
            if not key_matches(request.rel_url.raw_path, self.key):
                self.refused("refused %s without this launch's key in its URL",
                             "a WebSocket" if request.headers.get("Upgrade", "").lower()
                             == "websocket" else "an HTTP request")
                return web.Response(status=403, text="403: forbidden\n",
                                    headers=SAFE_HEADERS)
            response: web.StreamResponse = await handler(request)
            if not response.prepared:
                response.headers.update(SAFE_HEADERS)
            return response

        async def handle_root(self, request: web.Request) -> web.StreamResponse:
            """``/KEY`` without its slash: the page is at ``/KEY/``."""
            raise web.HTTPFound(f"/{self.key}/")

        async def handle_index(self, request: web.Request) -> web.StreamResponse:
            """The page (textual-serve's template), its URLs under the key."""
            base = f"{self.public_url}/{self.key}"
            context = {
                "font_size": to_int(request.query.get("fontsize", "16"), 16),
                "app_websocket_url": "ws:" + base.split(":", 1)[1] + "/ws",
                "config": {"static": {"url": base + "/static/"}},
                "application": {"name": self.title},
            }
            return aiohttp_jinja2.render_template("app_index.html", request, context)

        async def handle_static(self, request: web.Request) -> web.StreamResponse:
            """One of textual-serve's static files (scripts, styles, fonts)."""
            root = Path(self.statics_path).resolve()
            target = (root / request.match_info["path"]).resolve()
            if not target.is_relative_to(root) or not target.is_file():
                raise web.HTTPNotFound()
            return web.FileResponse(target)

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            """One browser session, for this server's own page only: textual-serve's
            handler, tracked for shutdown."""
            origin = request.headers.get("Origin")
            if origin is None or origin.lower() not in self.origins:
                self.refused("refused a WebSocket from origin %r: only this server's own "
                             "page may open one", None if origin is None
                             else origin[:LOG_CHARS])
                raise web.HTTPForbidden(text="403: forbidden\n")
            task = asyncio.current_task()
            assert task is not None
            self._sessions.add(task)
            try:
                return await super().handle_websocket(request)
            finally:
                self._sessions.discard(task)

        async def on_shutdown(self, app: web.Application) -> None:
            """Ask every session's ``rtop`` to quit; terminate those that do not."""
            # a cancelled session handler sends its app "quit" and waits for it to exit
            for task in self._sessions:
                task.cancel()
            if self._sessions:
                await asyncio.wait(self._sessions, timeout=SESSION_GRACE_S)
            await _end_children(psutil.Process())

    return RtopServer()


async def _end_children(me: Any, grace_s: float = 2.0) -> None:
    """Terminate, then kill, the child processes of ME (a psutil.Process) still alive.

    Reaping is left to asyncio's child watcher, which started them: this only waits
    until each is gone or a zombie.
    """
    import psutil

    def alive() -> list[Any]:
        out = []
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.status() != psutil.STATUS_ZOMBIE:
                    out.append(child)
        return out

    for sig in ("terminate", "kill"):
        procs = alive()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                getattr(proc, sig)()
        deadline = time.monotonic() + grace_s
        while procs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            procs = alive()
        if not procs:
            return


def serve_web(argv: list[str], *, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Serve ``rtop ARGV`` at http://HOST:PORT/KEY/ until SIGINT/SIGTERM; returns an
    exit code.

    PORT 0 picks a free port; KEY is a fresh random one, and the page's address, key
    included, is printed once. Each browser tab runs its own ``rtop ARGV``.
    """
    try:
        import textual_serve.server  # noqa: F401
    except ImportError:
        print("rtop --web needs textual-serve: pip install textual-serve", file=sys.stderr)
        return 2
    if port == 0:
        port = free_port(host)
    why = _check_bindable(host, port)
    if why is not None:
        print(f"rtop --web: cannot listen on {host}:{port}: {why}", file=sys.stderr)
        return 1
    key = new_key()
    server = _make_server(web_command(argv), host, port, key)
    print(f"rtop: serving the UI at {page_url(host, port, key)} (this address holds the "
          "key that lets a browser in: keep it to yourself; Ctrl-C to stop)", flush=True)
    # Server.serve() takes the current event loop: give it a fresh one explicitly
    asyncio.set_event_loop(asyncio.new_event_loop())
    try:
        server.serve()
    except OSError as exc:
        print(f"rtop --web: {exc}", file=sys.stderr)
        return 1
    return 0
