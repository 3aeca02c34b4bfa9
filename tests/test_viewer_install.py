"""The viewer's install: ``pip install "rtop-train[app]"`` on a laptop that only looks at
a cluster's runs, with no torch and no Ray, gives a working ``rtop report``, ``rtop
replay``, ``rtop status`` and UI.

Before: ``rtop report RUN.rtop`` ended in ``ModuleNotFoundError: No module named
'numpy'`` (the analysis imports numpy; no extra declared it). A fresh virtualenv is built
from this checkout with ``.[app]`` only (packages from the registry, as a user gets
them); a recording of a simulated 64-rank fleet with a straggler is read there.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import venv
from pathlib import Path

import pytest

from rtop.fleetsim import FleetSpec, write_recording

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def viewer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh venv with ``.[app]`` (its python), and a recording to view."""
    tmp = tmp_path_factory.mktemp("viewer")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # a copy of the sources (a build writes into the tree it builds from)
    src = tmp / "src"
    src.mkdir()
    for part in ("rtop", "collectors"):
        subprocess.run(["cp", "-r", str(ROOT / part), str(src / part)], check=True)
    for part in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / part).exists():
            subprocess.run(["cp", str(ROOT / part), str(src / part)], check=True)
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", f"{src}[app]"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = tmp / "fleet.rtop"
    write_recording(record, FleetSpec(ranks=64, seed=2, duration_s=60.0), "straggler")
    return py, record


def _run(py: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["RTOP_AUTOHUB"] = "0"
    return subprocess.run([str(py), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=py.parent)  # not the checkout: the installed package


def test_the_viewer_install_has_neither_torch_nor_ray(viewer):
    py, _ = viewer
    proc = _run(py, "-c", "import importlib.util as u; print(u.find_spec('torch'), "
                "u.find_spec('ray'))")
    assert proc.stdout.split() == ["None", "None"], proc.stdout + proc.stderr
    where = _run(py, "-c", "import rtop; print(rtop.__file__)")
    assert str(ROOT) not in where.stdout, where.stdout  # the installed copy, not ours


def test_rtop_report_reads_a_run(viewer):
    py, record = viewer
    rtop = py.with_name("rtop")
    text = subprocess.run([str(rtop), "report", str(record)], capture_output=True,
                          text=True, timeout=300)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "straggler" in text.stdout
    js = subprocess.run([str(rtop), "report", "--json", str(record)], capture_output=True,
                        text=True, timeout=300)
    assert js.returncode == 0, js.stderr[-3000:]
    report = json.loads(js.stdout)
    assert len(report["ranks"]) == 64
    assert [f["kind"] for f in report["findings"] if f["kind"] == "straggler"]


@pytest.mark.parametrize("command", ["replay", "status", "report"])
def test_the_commands_answer_help(viewer, command):
    py, _ = viewer
    proc = subprocess.run([str(py.with_name("rtop")), command, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout


def test_the_ui_opens_a_recording(viewer):
    py, record = viewer
    script = textwrap.dedent(f"""
        import asyncio
        from rtop.tui.app import make_app
        from rtop.tui.source import ReplaySource

        async def main():
            app = make_app(ReplaySource({str(record)!r}, paused=True))
            async with app.run_test(size=(120, 40)) as pilot:
                for _ in range(200):
                    if app.snapshots_seen:
                        break
                    await pilot.pause(0.05)
                print("snapshots", app.snapshots_seen)
                print("ranks", len(app.snapshot["ranks"]["rank"]) if app.snapshot else 0)

        asyncio.run(main())
    """)
    proc = _run(py, "-c", script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    assert int(lines["snapshots"]) > 0 and int(lines["ranks"]) == 64, proc.stdout
