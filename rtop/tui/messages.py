"""Messages the data source posts to the app (from its worker thread)."""

from __future__ import annotations

from textual.message import Message

from rtop.run.snapshot import RankDetail, Snapshot


class SnapshotReceived(Message):
    """A new snapshot of the run. Only the newest one waits in the queue."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        """A newer snapshot makes an older, unprocessed one pointless."""
        return isinstance(message, SnapshotReceived)


class DetailReceived(Message):
    """One rank's full window (the rank detail screen's data)."""

    def __init__(self, detail: RankDetail) -> None:
        super().__init__()
        self.detail = detail

    def can_replace(self, message: Message) -> bool:
        """Only the newest detail of the same rank matters."""
        return isinstance(message, DetailReceived) and \
            message.detail["rank"] == self.detail["rank"]


class SourceStatus(Message):
    """What the source is doing: connected, retrying, replay position, an error."""

    def __init__(self, text: str, error: bool = False) -> None:
        super().__init__()
        self.text = text
        self.error = error

    def can_replace(self, message: Message) -> bool:
        """Only the latest status matters."""
        return isinstance(message, SourceStatus)


class ViewChanged(Message):
    """A screen shows other rows (scrolled, sorted, moved its cursor, came back on top):
    the app asks the source for its view (``view_request()``) again."""

    def can_replace(self, message: Message) -> bool:
        """One pending change is enough: the app reads the screens' views then."""
        return isinstance(message, ViewChanged)
