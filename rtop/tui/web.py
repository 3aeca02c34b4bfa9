"""``rtop --web``: the same UI in a browser, served by textual-serve.

textual-serve runs ``python -m rtop ARGS`` once per browser tab and streams the
terminal to the page. It listens on loopback only: the page gives whoever opens it the
same view as the terminal UI, so reach it over an SSH tunnel
(``ssh -L 8000:localhost:8000 host``) rather than exposing it.
"""

from __future__ import annotations

import shlex
import sys


def web_command(argv: list[str]) -> str:
    """The command textual-serve runs for each browser session."""
    return " ".join(shlex.quote(a) for a in [sys.executable, "-m", "rtop", *argv])


def serve_web(argv: list[str], *, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Serve ``rtop ARGV`` at http://HOST:PORT until interrupted; returns an exit code."""
    try:
        from textual_serve.server import Server
    except ImportError:
        print("rtop --web needs textual-serve: pip install textual-serve", file=sys.stderr)
        return 2
    print(f"rtop: serving the UI at http://{host}:{port} (Ctrl-C to stop)", flush=True)
    Server(web_command(argv), host=host, port=port, title="rtop").serve()
    return 0
