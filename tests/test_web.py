"""``rtop --web`` end to end: a real server process, a real headless Chromium.

The page is textual-serve's: xterm.js draws the terminal on a canvas, so the test reads
the text from xterm's own buffer. textual.js keeps its ``Terminal`` in a local; a script
run before the page's own captures it when textual.js assigns it to ``this.terminal``.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

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
    base = f"http://127.0.0.1:{port}/"
    started = time.monotonic()
    server = start_web(port, tmp_path / "web.log", "replay", str(recording), "--speed", "2")
    sessions: list[int] = []
    try:
        assert listening_addresses(server.pid) == {"127.0.0.1"}, "must listen on loopback only"
        text = ""
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM,
                                         args=["--no-sandbox", "--headless=new"])
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
