"""Reading local record files (JSONL, gzipped JSONL, Parquet) with errors that name file and line.

Every dataset in this package reads through :func:`iter_records`, which yields one
``(number, record_or_error)`` per input record, never dropping one: a line that cannot be
decoded or parsed is yielded as a :class:`DataError`, so the caller decides (through a
:class:`SkipPolicy`) whether it ends the run or becomes a counted, logged skip.

Record numbers are 1-based: the line number in a JSONL file (blank lines are not records
but still count as lines, so numbers match an editor), the row number in a Parquet file.
"""

from __future__ import annotations

import collections
import gzip
import json
import logging
import os
from typing import Any, Iterable, Iterator

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)


class DataError(ValueError):
    """A record that cannot be used; the message names the file, the record number and why."""

    def __init__(self, path: str | os.PathLike, line: int | None, reason: str, detail: str = ""):
        self.path = os.fspath(path)
        self.line = line
        self.reason = reason
        """Short, stable category used as the key of skip counters (e.g. ``"malformed json"``)."""
        self.detail = detail
        where = f"{self.path}:{line}" if line is not None else self.path
        # A detail that is just a quoted name reads as part of the reason: "missing field 'rejected'".
        joiner = " " if detail.startswith("'") else ": "
        super().__init__(f"{where}: {reason}" + (f"{joiner}{detail}" if detail else ""))


class RecordError(ValueError):
    """Raised by record parsers, which do not know the file; turned into a DataError by the reader."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class SkipPolicy:
    """Raise on the first bad record, or count and log each one (``skip_invalid=True``).

    ``skipped`` maps a reason to how many records were skipped for it.
    """

    def __init__(self, *, skip_invalid: bool):
        self.skip_invalid = skip_invalid
        self.skipped: collections.Counter[str] = collections.Counter()

    def handle(self, error: DataError) -> None:
        """Count and log ``error`` when skipping invalid records, otherwise raise it."""
        if not self.skip_invalid:
            raise error
        self.skip(error)

    def skip(self, error: DataError) -> None:
        """Count and log a skip that is always allowed (e.g. a preference tie)."""
        self.skipped[error.reason] += 1
        logger.warning("skipping record %s", error)


def check_encodable(texts: Iterable[str]) -> None:
    """RecordError for text that is not valid Unicode (JSON can escape lone surrogates)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RecordError("invalid utf-8", f"lone surrogate at character {exc.start}") from None


def record_error(path: str | os.PathLike, line: int, error: RecordError) -> DataError:
    return DataError(path, line, error.reason, error.detail)


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    """Yield ``(record_number, record)`` for every record of a local file; bad ones as DataError.

    The format follows the suffix: ``.jsonl``/``.json`` (one JSON object per line, optionally
    ``.gz``) or ``.parquet`` (needs ``pyarrow``).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: data file not found")
    if os.path.isdir(path):
        raise DataError(path, None, "not a file", "expected a .jsonl or .parquet file, got a directory")
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        yield from _iter_parquet(path)
    elif lower.endswith(JSONL_SUFFIXES):
        yield from _iter_jsonl(path)
    else:
        expected = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
        raise DataError(path, None, "unknown file type", f"expected one of {expected}")


def count_records(path: str | os.PathLike) -> int:
    """Number of records :func:`iter_records` yields for ``path`` (good and bad)."""
    return sum(1 for _ in iter_records(path))


def _iter_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            yield line_no, _parse_json_line(path, line_no, raw)


def _parse_json_line(path: str, line_no: int, raw: bytes) -> dict[str, Any] | DataError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return DataError(path, line_no, "invalid utf-8", f"byte {exc.start}: {exc.reason}")
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return DataError(path, line_no, "malformed json", str(exc))
    if not isinstance(record, dict):
        return DataError(path, line_no, "not an object", f"expected a JSON object, got {type(record).__name__}")
    return record


def _iter_parquet(path: str) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError(path, None, "reading Parquet needs pyarrow", "pip install pyarrow, or convert the file to "
                        "JSON Lines") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(path, None, "unreadable parquet", str(exc)) from exc
    for row_no, record in enumerate(table.to_pylist(), start=1):
        yield row_no, record


class LoadedRecords:
    """Items loaded up front from local files, with per-reason skip counts.

    ``len(self) + sum(skipped.values())`` is the number of input records; an empty result is an
    error naming the files (``what`` says what was expected).
    """

    def __init__(self, paths: list[str], items: list, skipped: collections.Counter, *, what: str) -> None:
        if not items:
            raise DataError(", ".join(paths), None, f"no usable {what}", f"skipped: {dict(skipped)}")
        self.paths = paths
        self.items = items
        self.skipped = skipped

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]
