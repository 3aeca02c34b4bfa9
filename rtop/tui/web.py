"""``rtop --web``: the same UI in a browser, served by textual-serve.

textual-serve runs ``python -m rtop ARGS`` once per browser tab and streams the
terminal to the page. It listens on loopback only: the page gives whoever opens it the
same view as the terminal UI, so reach it over an SSH tunnel that keeps the port
(``ssh -L 8000:localhost:8000 host``: the page connects back to its websocket at that
port) rather than exposing it.

SIGINT and SIGTERM stop the server cleanly: each open tab's ``rtop`` is asked to quit,
and any that has not after a few seconds is terminated, so none outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import shlex
import socket
import sys
import time
from typing import Any

#: seconds each browser session's ``rtop`` gets to quit on shutdown before it is terminated
SESSION_GRACE_S = 5.0


def web_command(argv: list[str]) -> str:
    """The shell command textual-serve runs for each browser session.

    ``exec`` makes the shell become ``rtop`` itself, so the server's children are the
    sessions and a signal to one reaches the app rather than a waiting shell.
    """
    return "exec " + " ".join(shlex.quote(a) for a in [sys.executable, "-m", "rtop", *argv])


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


def _make_server(command: str, host: str, port: int) -> Any:
    """A textual-serve Server that ends its sessions' processes when it stops."""
    import psutil
    from aiohttp import web
    from textual_serve.server import Server

    class RtopServer(Server):
        """textual-serve's Server, plus a shutdown that leaves no session behind."""

        def __init__(self) -> None:
            super().__init__(command, host=host, port=port, title="rtop")
            self._sessions: set[asyncio.Task[Any]] = set()

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            """One browser session: textual-serve's handler, tracked for shutdown."""
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
    """Serve ``rtop ARGV`` at http://HOST:PORT until SIGINT/SIGTERM; returns an exit code.

    PORT 0 picks a free port. Each browser tab runs its own ``rtop ARGV``.
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
    server = _make_server(web_command(argv), host, port)
    print(f"rtop: serving the UI at http://{host}:{port} (Ctrl-C to stop)", flush=True)
    # Server.serve() takes the current event loop: give it a fresh one explicitly
    asyncio.set_event_loop(asyncio.new_event_loop())
    try:
        server.serve()
    except OSError as exc:
        print(f"rtop --web: {exc}", file=sys.stderr)
        return 1
    return 0
