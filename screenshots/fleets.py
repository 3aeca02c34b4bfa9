"""The fleet view's screenshots: simulated fleets of 1,024 and 16,384 ranks with a slow
node (``rtop.fleetsim``), written as recordings, replayed through the real state and
diagnosis, and shown by the real app.

The recordings and the snapshots replayed from them are cached (they take minutes at
16,384 ranks): ``$RTOP_SCREENSHOT_CACHE``, else ``~/.cache/rtop/screenshots``. Bump
:data:`VERSION` when the scenes change.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors import wire
from rtop.fleetsim import FleetSpec, write_recording
from rtop.run.snapshot import Snapshot
from rtop.tui.app import RtopApp, make_app
from rtop.tui.source import ReplaySource, StaticSource

VERSION = 1


def cache_dir() -> Path:
    """Where the recordings and snapshots are kept between runs."""
    env = os.environ.get("RTOP_SCREENSHOT_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "rtop" / "screenshots"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    return base


@dataclass(frozen=True)
class FleetScene:
    """A simulated fleet, the moment shown, the terminal and the keys pressed."""

    name: str
    ranks: int
    seed: int
    at_s: float
    size: tuple[int, int]
    caption: str
    duration_s: float = 62.0
    scenario: str = "slow_node"
    press: tuple[str, ...] = ()

    def stem(self) -> str:
        """The cached files' name."""
        return (f"fleet-{self.ranks}-{self.scenario}-s{self.seed}-{self.duration_s:g}s"
                f"-v{VERSION}")

    def snapshot(self) -> Snapshot:
        """The run's full snapshot at ``at_s`` (from the cache, else made)."""
        base = cache_dir()
        snap_path = base / f"{self.stem()}-at{self.at_s:g}.snap"
        if snap_path.exists():
            data = snap_path.read_bytes()
            return wire.decode_body(data[wire.HEADER_BYTES:]).payload  # type: ignore[return-value]
        run = base / f"{self.stem()}.rtop"
        if not run.exists():
            t = time.perf_counter()
            part = run.with_suffix(".part")
            write_recording(part, FleetSpec(ranks=self.ranks, seed=self.seed,
                                            duration_s=self.duration_s), self.scenario)
            part.replace(run)
            print(f"  wrote {run} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        t = time.perf_counter()
        snap, _ = ReplaySource(run).snapshot_at(self.at_s)
        print(f"  replayed {run.name} to {self.at_s:g} s in {time.perf_counter() - t:.0f} s",
              file=sys.stderr)
        data = wire.encode(wire.KIND_SNAPSHOT, snap)
        snap_path.write_bytes(data)
        return wire.decode_body(data[wire.HEADER_BYTES:]).payload  # type: ignore[return-value]

    def app(self) -> RtopApp:
        """The app on the snapshot (each view of it made as a live hub makes it)."""
        return make_app(StaticSource([self.snapshot()], title=f"{self.stem()}.rtop",
                                     interval_s=3600))

    def run_before(self) -> Any:
        """Wait for the fleet view and its first drawing, press the keys."""
        async def go(pilot: Any) -> None:
            from rtop.tui.fleet import FleetScreen

            app = pilot.app
            for _ in range(400):
                if isinstance(app.screen, FleetScreen) and app.screen.data is not None:
                    break
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            for key in self.press:
                await pilot.press(key)
                await pilot.pause(0.1)
            await pilot.pause(0.5)
        return go


FLEET_SCENES = (
    FleetScene("fleet-1024", 1024, seed=0, at_s=60.0, size=(120, 36),
               caption="1,024 ranks: a slow node is a bar on the map, named beside it"),
    FleetScene("fleet-1024-80x24", 1024, seed=0, at_s=60.0, size=(80, 24),
               caption="the same at 80×24: folded to nodes, a cell each"),
    FleetScene("fleet-16384", 16384, seed=3, at_s=60.0, size=(160, 48),
               caption="16,384 ranks on 2,048 nodes, folded: one cell per node"),
)
