"""``rtop --web`` end to end: a real server process, a real headless Chromium.

The page is textual-serve's: xterm.js draws the terminal on a canvas, so the test reads
the text from xterm's own buffer. textual.js keeps its ``Terminal`` in a local; a script
run before the page's own captures it when textual.js assigns it to ``this.terminal``.

The page lives under a per-launch key (``http://127.0.0.1:PORT/KEY/``, printed once)
and the WebSocket opens only for the server's own origin: the tests below play the
attacks (no key, a wrong key, another origin's page in the same browser, a raw
handshake with a foreign or missing Origin) and check that the server refused them
before starting any session.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from rtop.tui.web import KEY_BYTES, allowed_origins, key_matches, new_key, page_url
from rtop.workload import Faults, free_port

RTOP = [sys.executable, "-m", "rtop"]
FIXTURE = Path(__file__).parent / "fixtures" / "starved.rtop"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Run before any of the page's scripts: when something sets ``.terminal`` to an
# xterm.js Terminal (textual.js: ``this.terminal = new Terminal(...)``), keep it in
# window.__rtopTerminal. The property itself behaves as a plain one.
CAPTURE_TERMINAL = """
Object.defineProperty(Object.prototype, "terminal", {
  configurable: true,
  get() { return undefined; },
  set(value) {
    Object.defineProperty(this, "terminal",
      {value, writable: true, enumerable: true, configurable: true});
    if (value && value.buffer && value.buffer.active) window.__rtopTerminal = value;
  },
});
"""

# The terminal's screen as text, one line per row; null until there is a terminal.
READ_SCREEN = """() => {
  const term = window.__rtopTerminal;
  if (term) {
    const buf = term.buffer.active, rows = [];
    for (let i = 0; i < buf.length; i++) {
      const line = buf.getLine(i);
      rows.push(line ? line.translateToString(true) : "");
    }
    return rows.join("\\n");
  }
  const dom = document.querySelector(".xterm-rows");  // xterm's DOM renderer, if used
  return dom ? dom.innerText : null;
}"""

STARVED_ROW = re.compile(r"^\s*1\s+\S+\s+STARVED\b", re.M)
PAGE_URL = re.compile(r"serving the UI at (http://127\.0\.0\.1:(\d+)/([A-Za-z0-9_-]+)/)")

# Opens a WebSocket to ``url`` and settles with what became of it: "open" (a session
# started), "error" (the handshake was refused) or "closed CODE".
PROBE_WS = """(url) => new Promise((resolve) => {
  const ws = new WebSocket(url);
  ws.onopen = () => { resolve("open"); ws.close(); };
  ws.onerror = () => resolve("error");
  ws.onclose = (e) => resolve("closed " + e.code);
})"""


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real recording in which rank 1 is starved of data."""
    if FIXTURE.exists():
        return FIXTURE
    from tests.scenarios import run_scenario  # ~30 s: a real DDP job against a hub

    out = run_scenario(tmp_path_factory.mktemp("rec"),
                       Faults(loader_sleep_s={1: 0.030}, start_step=40), world=3,
                       duration_s=20.0, check=False, grace_s=2.0,
                       until=lambda o: "starved_rank" in o.kinds)
    return Path(out.record)


def start_web(port: int, log: Path, *argv: str) -> subprocess.Popen[bytes]:
    """``rtop --web --web-port PORT ARGV``, once it accepts connections."""
    with log.open("wb") as out:
        proc = subprocess.Popen([*RTOP, "--web", "--web-port", str(port), *argv],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"rtop --web exited {proc.returncode}:\n{log.read_text()}")
            time.sleep(0.1)
    proc.kill()
    pytest.fail(f"rtop --web did not listen on {port}:\n{log.read_text()}")


def printed_url(log: Path, port: int) -> tuple[str, str]:
    """The page's address that ``rtop --web`` printed, and the key in it."""
    found = PAGE_URL.search(log.read_text())
    assert found, f"no page address printed:\n{log.read_text()}"
    assert int(found.group(2)) == port
    return found.group(1), found.group(3)


def stop_web(server: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM, and a clean exit within 20 s."""
    server.terminate()
    try:
        rc = server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        pytest.fail("rtop --web did not exit within 20 s of SIGTERM")
    assert rc == 0, log.read_text()


@pytest.fixture
def web(recording: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path,
                                                           int, str, str]]:
    """A running ``rtop --web replay``: (process, log, port, page url, key)."""
    port = free_port()
    log = tmp_path / "web.log"
    server = start_web(port, log, "replay", str(recording))
    url, key = printed_url(log, port)
    try:
        yield server, log, port, url, key
    finally:
        stop_web(server, log)


def sessions_of(pid: int) -> list[int]:
    """The pids of PID's sessions (its child processes that have not exited)."""
    return [p.pid for p in psutil.Process(pid).children(recursive=True) if not gone(p.pid)]


def launch_chromium(pw: Any) -> Any:
    """A headless Chromium (the system's) under Playwright."""
    return pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--headless=new"])


def handshake(port: int, path: str, origin: str | None) -> str:
    """A raw WebSocket opening handshake for PATH with ORIGIN (None: no Origin header);
    the server's status line."""
    lines = [f"GET {path}?width=80&height=24 HTTP/1.1", f"Host: 127.0.0.1:{port}",
             "Upgrade: websocket", "Connection: Upgrade", "Sec-WebSocket-Version: 13",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="]
    if origin is not None:
        lines.append(f"Origin: {origin}")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\r\n", 1)[0].decode()


def http_get(port: int, path: str) -> tuple[int, bytes]:
    """GET PATH from 127.0.0.1:PORT: (status, body)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def listening_addresses(pid: int) -> set[str]:
    """The IP addresses process PID listens on (TCP)."""
    proc = psutil.Process(pid)
    conns = (proc.net_connections if hasattr(proc, "net_connections")  # psutil >= 6
             else proc.connections)(kind="tcp")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}


def gone(pid: int) -> bool:
    """Whether PID has exited (a zombie nobody reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(180)
def test_web_replay_shows_ranks_in_chromium(recording: Path, tmp_path: Path) -> None:
    """The browser page shows the ranks table, rank 1 STARVED; SIGTERM ends it all."""
    if CHROMIUM is None:
        pytest.skip("chromium not installed: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    port = free_port()
    started = time.monotonic()
    server = start_web(port, tmp_path / "web.log", "replay", str(recording), "--speed", "2")
    base, key = printed_url(tmp_path / "web.log", port)
    sessions: list[int] = []
    try:
        assert listening_addresses(server.pid) == {"127.0.0.1"}, "must listen on loopback only"
        text = ""
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 800})
                # only our server: the page's web-font link must not wait on the network
                page.route("**/*", lambda route: route.continue_()
                           if route.request.url.startswith(base) else route.abort())
                page.add_init_script(CAPTURE_TERMINAL)
                page.goto(base)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    text = page.evaluate(READ_SCREEN) or ""
                    if "rank" in text and "step ms" in text and STARVED_ROW.search(text):
                        break
                    time.sleep(0.25)
                # the footer lists the keys once the page has focus (a headless page
                # never gets it by itself: Textual holds the footer while blurred)
                page.mouse.click(700, 600)
                footer = ""
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and "q quit" not in footer:
                    time.sleep(0.25)
                    rows = [r for r in (page.evaluate(READ_SCREEN) or "").split("\n")
                            if r.strip()]
                    footer = rows[-1] if rows else ""
                page.screenshot(path=str(tmp_path / "web.png"))
                sessions = [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
            finally:
                browser.close()
        shown = f"page text:\n{text}\n(screenshot: {tmp_path / 'web.png'})"
        assert "rank" in text and "step ms" in text, f"no ranks table header; {shown}"
        assert STARVED_ROW.search(text), f"no STARVED row for rank 1; {shown}"
        assert "q quit" in footer and "details" in footer, f"footer: {footer!r}; {shown}"
        assert sessions, "the page's session runs no rtop process"
    finally:
        server.terminate()
        try:
            rc = server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            pytest.fail("rtop --web did not exit within 20 s of SIGTERM")
    assert rc == 0, (tmp_path / "web.log").read_text()
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in sessions) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in sessions), "a session's rtop outlived the server"
    # printed once, and nowhere else: no access log line, no traceback carries it
    assert (tmp_path / "web.log").read_text().count(key) == 1, (tmp_path / "web.log").read_text()
    print(f"web replay test: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(60)
def test_web_exits_on_sigint(recording: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) stops an idle ``rtop --web`` promptly with status 0."""
    server = start_web(free_port(), tmp_path / "web.log", "replay", str(recording))
    server.send_signal(signal.SIGINT)
    try:
        rc = server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        pytest.fail("rtop --web did not exit within 10 s of SIGINT")
    assert rc == 0, (tmp_path / "web.log").read_text()


def test_web_refuses_a_busy_port(recording: Path, tmp_path: Path) -> None:
    """A port already in use is a one-line error and status 1, not a traceback."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([*RTOP, "--web", "--web-port", str(port), "replay",
                              str(recording)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


# ---- the key and the Origin check (issue 12, finding 4) ------------------------------


def test_key_is_random_and_checked_whole() -> None:
    """Each launch's key is fresh and long; only the exact first path segment matches."""
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    key = keys.pop()
    assert len(key) >= KEY_BYTES * 4 // 3 and re.fullmatch(r"[A-Za-z0-9_-]+", key)
    for good in (f"/{key}/", f"/{key}", f"/{key}/ws", f"/{key}/static/js/textual.js"):
        assert key_matches(good, key), good
    for bad in ("", "/", "//", f"{key}/", f"/{key[:-1]}/", f"/{key}x/", f"/x{key}/",
                f"/static/{key}/", f"/{key.upper() if key != key.upper() else key.lower()}/",
                "/\udcff/", "/é/", f"/{key}%2F/"):
        assert not key_matches(bad, key), bad
    assert page_url("127.0.0.1", 8000, key) == f"http://127.0.0.1:8000/{key}/"
    assert allowed_origins("127.0.0.1", 8000) == {"http://127.0.0.1:8000",
                                                  "http://localhost:8000"}
    assert "http://[::1]:8000" in allowed_origins("::1", 8000)


@pytest.mark.timeout(120)
def test_web_without_the_key_is_403_in_chromium(web: Any) -> None:
    """Chromium on the server's address without the key (or with a wrong one) gets 403
    and nothing else: no page, no script, no terminal, no session."""
    if CHROMIUM is None:
        pytest.skip("chromium not installed: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    server, log, port, url, key = web
    origin = f"http://127.0.0.1:{port}"
    wrong = new_key()
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page()
            page.add_init_script(CAPTURE_TERMINAL)
            for path in ("/", f"/{wrong}/", f"/{key[:-1]}/", "/static/js/textual.js",
                         f"/{wrong}/static/js/textual.js", "/ws", f"/{wrong}/ws"):
                response = page.goto(origin + path)
                assert response is not None and response.status == 403, path
                assert page.inner_text("body").strip() == "403: forbidden", path
                assert page.evaluate("() => document.scripts.length") == 0, path
            time.sleep(1.0)  # a terminal, had one been served, would be drawn by now
            assert page.evaluate(READ_SCREEN) is None
            assert sessions_of(server.pid) == [], "a request without the key started a session"
            # the same browser with the key: the page and its script are served
            response = page.goto(url)
            assert response is not None and response.status == 200
            assert response.headers.get("referrer-policy") == "no-referrer"
            assert f"ws://127.0.0.1:{port}/{key}/ws" in page.content()
        finally:
            browser.close()
    assert "refused an HTTP request without this launch's key" in log.read_text()


@pytest.mark.timeout(120)
def test_web_refuses_a_websocket_from_another_origin_in_chromium(web: Any,
                                                                tmp_path: Path) -> None:
    """A page of another origin (here another local server), even one that knows the
    key, cannot open the WebSocket from the user's browser: the server refuses the
    handshake and starts no session. The same script on rtop's own page does open one."""
    if CHROMIUM is None:
        pytest.skip("chromium not installed: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    server, log, port, url, key = web
    ws_url = f"ws://127.0.0.1:{port}/{key}/ws?width=80&height=24"
    site = tmp_path / "evil"
    site.mkdir()
    (site / "index.html").write_text(
        "<!doctype html><title>not rtop</title><script>"
        f"window.attempt = ({PROBE_WS})({ws_url!r});</script>")
    evil = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    evil_origin = f"http://127.0.0.1:{evil.server_address[1]}"
    try:
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            try:
                page = browser.new_page()
                response = page.goto(evil_origin + "/")
                assert response is not None and response.status == 200
                outcome = page.evaluate("() => window.attempt")
                assert outcome != "open", "a foreign page opened rtop's WebSocket"
                time.sleep(0.5)
                assert sessions_of(server.pid) == [], "a foreign page started a session"
                seen = log.read_text()
                assert f"refused a WebSocket from origin {evil_origin!r}" in seen, seen

                # control: the very same script, run by rtop's own page, gets a session
                own = browser.new_page()
                own.route("**/*", lambda route: route.continue_()
                          if route.request.url.startswith(url) else route.abort())
                own.goto(url)
                assert own.evaluate(PROBE_WS, ws_url) == "open"
            finally:
                browser.close()
    finally:
        evil.shutdown()
        evil.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """A static file server that does not log every request to stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.timeout(60)
def test_web_refuses_raw_websocket_handshakes(web: Any) -> None:
    """Raw handshakes: a foreign, missing, look-alike or other-port Origin, or a wrong
    or missing key, get 403 and no session; the server's own Origin with the key gets
    101 (so the refusals are not an artefact of the test's handshake)."""
    server, log, port, _url, key = web
    ws = f"/{key}/ws"
    refused = {
        "foreign origin": (ws, "http://evil.example"),
        "no key": ("/ws", f"http://127.0.0.1:{port}"),
        "no origin": (ws, None),
        "wrong key": (f"/{new_key()}/ws", f"http://127.0.0.1:{port}"),
        "null origin": (ws, "null"),
        "other port": (ws, f"http://127.0.0.1:{free_port()}"),
        "look-alike host": (ws, f"http://127.0.0.1:{port}.evil.example"),
        "https": (ws, f"https://127.0.0.1:{port}"),
        "with a path": (ws, f"http://127.0.0.1:{port}/"),
        "key cut short": (f"/{key[:-1]}/ws", f"http://127.0.0.1:{port}"),
    }
    for why, (path, origin) in refused.items():
        answer = handshake(port, path, origin)
        assert answer.startswith("HTTP/1.1 403"), f"{why}: {answer}"
    assert sessions_of(server.pid) == [], "a refused handshake started a session"
    seen = log.read_text()
    assert "refused a WebSocket from origin 'http://evil.example'" in seen, seen
    assert "refused a WebSocket without this launch's key" in seen, seen
    # rate-limited: ten refusals in a burst, five lines and no more
    assert seen.count("refused a WebSocket") == 5, seen
    assert key not in seen.split("\n", 1)[1], "the key was logged"

    # what must still work: the page's own origin, by either loopback name
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        assert handshake(port, ws, origin).startswith("HTTP/1.1 101"), origin
    for path in ("/", "/static/js/textual.js", f"/{new_key()}/"):
        status, body = http_get(port, path)
        assert (status, body) == (403, b"403: forbidden\n"), path
    status, body = http_get(port, f"/{key}/")
    assert status == 200 and b"textual.js" in body
