"""Writing exported tables as Parquet files, with pyarrow (the ``export`` extra).

Each table is written to a hidden partial file beside its final name (``.steps.parquet.
partial``), created 0600 and never through a link, chunk by chunk (one row group per
chunk, zstd-compressed), and renamed into place only when every table of the export is
whole (:meth:`ParquetTables.commit`); an export that fails leaves no partial file.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Final

from rtop.export.columns import Column

#: What to install when pyarrow is missing.
EXTRA_HINT: Final = 'pip install "rtop-train[export]"'


class MissingExtra(RuntimeError):
    """pyarrow is not installed: the message says which extra brings it."""


def require_pyarrow() -> Any:
    """``pyarrow.parquet`` (its module), or :class:`MissingExtra` saying what to install."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingExtra(
            f"writing Parquet needs pyarrow, which is not installed here ({exc}); "
            f"install rtop's export extra: {EXTRA_HINT}") from None
    return pq


def _arrow_type(kind: str) -> Any:
    import pyarrow as pa

    return {"int": pa.int64(), "float": pa.float64(), "text": pa.string(),
            "bool": pa.bool_(), "ints": pa.list_(pa.int64()),
            "texts": pa.list_(pa.string())}[kind]


def schema(columns: tuple[Column, ...], table: str, meta: dict[str, str]) -> Any:
    """The Arrow schema of a table: its columns' types, each column's doc in its field's
    metadata, and ``rtop.table`` and ``meta`` in the schema's."""
    import pyarrow as pa

    fields = [pa.field(c.name, _arrow_type(c.kind), nullable=True,
                       metadata={"doc": c.doc} if c.doc else None) for c in columns]
    return pa.schema(fields, metadata={"rtop.table": table, **meta})


def _open_private(path: Path) -> Any:
    """A new file at ``path`` for writing, 0600, refused if anything is there (a link
    included)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o600)
    return os.fdopen(fd, "wb")


def partial_path(final: Path) -> Path:
    """Where a file is written before it is whole."""
    return final.with_name(f".{final.name}.partial")


class ParquetTables:
    """The Parquet files of one export in ``directory``: open one per table, write its
    chunks, then :meth:`commit` (all renamed into place) or :meth:`abort` (all
    removed)."""

    def __init__(self, directory: Path, meta: dict[str, str]) -> None:
        self.pq = require_pyarrow()
        self.directory = directory
        self.meta = meta
        self._writers: dict[str, tuple[Any, Any, Any, Path]] = {}  # file: writer, f, schema
        self._extra: list[tuple[Path, Path]] = []  # (partial, final) of other files

    def final(self, name: str) -> Path:
        """The final path of table ``name``."""
        return self.directory / f"{name}.parquet"

    def open(self, name: str, columns: tuple[Column, ...]) -> None:
        """Start table ``name`` (its partial file)."""
        part = partial_path(self.final(name))
        f = _open_private(part)
        sch = schema(columns, name, self.meta)
        writer = self.pq.ParquetWriter(f, sch, compression="zstd")
        self._writers[name] = (writer, f, sch, part)

    def write(self, name: str, data: dict[str, list[Any]]) -> None:
        """Append one chunk (columns by name, all as long) to table ``name``."""
        import pyarrow as pa

        writer, _, sch, _ = self._writers[name]
        n = len(next(iter(data.values()))) if data else 0
        if n == 0:
            return
        arrays = [pa.array(data[field.name], type=field.type) for field in sch]
        writer.write_table(pa.Table.from_arrays(arrays, schema=sch))

    def write_table(self, name: str, columns: tuple[Column, ...],
                    data: dict[str, list[Any]]) -> None:
        """A whole small table at once."""
        self.open(name, columns)
        self.write(name, data)

    def write_json(self, name: str, obj: Any) -> None:
        """A small JSON file beside the tables (renamed into place with them)."""
        final = self.directory / name
        part = partial_path(final)
        with _open_private(part) as f:
            f.write((json.dumps(obj, indent=2, allow_nan=False, default=str) + "\n")
                    .encode())
        self._extra.append((part, final))

    def finals(self) -> list[Path]:
        """Every file this export makes, as it will be named."""
        return [self.final(n) for n in self._writers] + [fin for _, fin in self._extra]

    def commit(self) -> None:
        """Close every table and rename every file into place."""
        moves: list[tuple[Path, Path]] = []
        for name, (writer, f, _, part) in self._writers.items():
            writer.close()
            f.close()
            moves.append((part, self.final(name)))
        for part, final in [*moves, *self._extra]:
            os.replace(part, final)
        self._writers.clear()
        self._extra.clear()

    def abort(self) -> None:
        """Close and remove every partial file (nothing of this export is left)."""
        for writer, f, _, part in self._writers.values():
            for close in (writer.close, f.close):
                with contextlib.suppress(Exception):  # removing it is what matters
                    close()
            part.unlink(missing_ok=True)
        for part, _ in self._extra:
            part.unlink(missing_ok=True)
        self._writers.clear()
        self._extra.clear()
