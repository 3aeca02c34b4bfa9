"""What a screen offers the app to be kept up to date: the app hands each new snapshot
(and the followed rank's detail) to every screen on the stack that takes it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rtop.run.snapshot import RankDetail, Snapshot


@runtime_checkable
class SnapshotView(Protocol):
    """A screen that draws the run's latest snapshot."""

    def show_snapshot(self, snap: Snapshot) -> None:
        """Draw ``snap`` (called on the UI thread, for every snapshot received)."""


@runtime_checkable
class RankDetailView(Protocol):
    """A screen that draws one rank's full detail."""

    def show_detail(self, detail: RankDetail) -> None:
        """Draw ``detail`` (it may be another rank's: the screen checks)."""
