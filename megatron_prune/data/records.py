"""Reading local record files (JSONL, JSON arrays, gzipped, Parquet) with errors that name file and line.

Every dataset in this package reads through :func:`iter_records`, which yields one
``(number, record_or_error)`` per input record, never dropping one: a line that cannot be
decoded or parsed is yielded as a :class:`DataError`, so the caller decides (through a
:class:`SkipPolicy`) whether it ends the run or becomes a counted, logged skip.

Record numbers are 1-based: the line number in a JSONL file (blank lines are not records
but still count as lines, so numbers match an editor), the element number in a JSON array, the
row number in a Parquet file.

A ``.json`` file (or ``.json.gz``) whose first character is ``[`` is one JSON array of records
(as exported by ``json.dump`` or ``Dataset.to_json(lines=False)``); any other ``.json`` file is
read as JSON Lines (one that holds a single pretty-printed object is one error
saying so). A UTF-8 byte order mark at the start of a file is ignored.
"""

from __future__ import annotations

import codecs
import collections
import functools
import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from typing import Any, Callable, Iterable, Iterator

from megatron_prune.ranks import first_rank

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
JSON_ARRAY_SUFFIXES = (".json", ".json.gz")
"""Suffixes whose files may hold one JSON array of records instead of JSON Lines."""
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES


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
        joiner = " " if re.fullmatch(r"'[^']*'", detail) else ": "
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

    def total(self) -> int:
        """Records skipped so far, for every reason."""
        return sum(self.skipped.values())

    def handle(self, error: DataError) -> None:
        """Count and log ``error`` when skipping invalid records, otherwise raise it."""
        if not self.skip_invalid:
            raise error
        self.skip(error)

    def skip(self, error: DataError) -> None:
        """Count and log a skip that is always allowed (e.g. a preference tie). Every rank reads
        the same files and counts the same skips; only rank 0 logs them, once each."""
        self.skipped[error.reason] += 1
        if first_rank():
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


def check_data_file(path: str | os.PathLike) -> None:
    """FileNotFoundError or DataError (a directory, an unknown suffix) unless ``path`` is a data
    file :func:`iter_records` can read; cheap enough to run before any rank works."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: data file not found")
    expected = ", ".join(DATA_SUFFIXES)
    if os.path.isdir(path):
        raise DataError(path, None, "is a directory", f"expected a data file ({expected})")
    if not path.lower().endswith(DATA_SUFFIXES):
        raise DataError(path, None, "unknown file type", f"expected one of {expected}")


def data_files_problem(flag: str, paths) -> str | None:
    """The first reason a file that ``flag`` names is not a data file the readers take, as the
    line a user sees (``"--data-path x.csv: unknown file type ..."``); None when every one is."""
    for path in paths or []:
        try:
            check_data_file(path)
        except (FileNotFoundError, DataError) as exc:
            return f"{flag} {exc}"
    return None


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    """Yield ``(record_number, record)`` for every record of a local file; bad ones as DataError.

    The format follows the suffix: ``.jsonl``/``.json`` (one JSON object per line, or for
    ``.json`` one JSON array of objects; optionally ``.gz``) or ``.parquet`` (needs ``pyarrow``).
    A file that cannot be read as a whole (a truncated gzip stream, a malformed JSON array) is a
    DataError without a record number.
    """
    path = os.fspath(path)
    check_data_file(path)
    if path.lower().endswith(PARQUET_SUFFIXES):
        yield from _iter_parquet(path)
    else:
        yield from _iter_json(path)


def _iter_json(path: str) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    compressed = path.lower().endswith(".gz")
    try:
        with (gzip.open if compressed else open)(path, "rb") as handle:
            if path.lower().endswith(JSON_ARRAY_SUFFIXES) and _first_byte(handle) == b"[":
                yield from _iter_json_array(path, handle.read())
            else:
                yield from _iter_json_lines(path, handle)
    except (EOFError, zlib.error, OSError) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(path, None, "unreadable gzip" if compressed else "unreadable file", str(exc)) from exc


def _first_byte(handle) -> bytes:
    """The first byte of ``handle`` after a byte order mark and whitespace; rewinds ``handle``."""
    head = handle.read(len(codecs.BOM_UTF8)).removeprefix(codecs.BOM_UTF8)
    while not head.strip():
        chunk = handle.read(1 << 16)
        if not chunk:
            break
        head = chunk
    handle.seek(0)
    return head.lstrip()[:1]


_ONE_VALUE_PROBE_LIMIT = 64 << 20
"""Files of up to this many bytes (decompressed) are parsed whole when their first line is malformed,
to say when they are one pretty-printed value; a larger file (a long JSON Lines file with a broken
first record) is read on line by line."""


def _iter_json_lines(path: str, handle) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    """Records line by line. Where the first record does not parse, a file that parses as one JSON
    object (or, outside a ``.json`` file, one array) is a single DataError saying so: read line by
    line, a pretty-printed one would give one "malformed json" per line."""
    first = True
    for line_no, raw in enumerate(handle, start=1):
        if line_no == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)
        if not raw.strip():
            continue
        record = _parse_json_line(path, line_no, raw)
        if (first and isinstance(record, DataError) and record.reason == "malformed json"
                and raw.lstrip()[:1] in (b"{", b"[")):
            _refuse_one_json_object(path, handle)
        first = False
        yield line_no, record


def _refuse_one_json_object(path: str, handle) -> None:
    """DataError when the whole file is one JSON object (pretty-printed, or a dict of columns) or,
    outside a ``.json`` file, one array; otherwise ``handle`` is left where it was."""
    position = handle.tell()
    handle.seek(0)
    data = handle.read(_ONE_VALUE_PROBE_LIMIT + 1)  # decompressed bytes, for a .gz file too
    try:
        value = None if len(data) > _ONE_VALUE_PROBE_LIMIT else json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        value = None
    handle.seek(position)
    if isinstance(value, dict):
        columns = value and all(isinstance(column, list) for column in value.values())
        what = "a dict of columns" if columns else "one JSON object spread over several lines"
        raise DataError(path, None, "not JSON Lines", f"the file is {what}; write one record per line (JSON "
                        "Lines), or a JSON array of records")
    if isinstance(value, list) and not path.lower().endswith(JSON_ARRAY_SUFFIXES):
        raise DataError(path, None, "not JSON Lines", "the file is one JSON array spread over several lines; name it "
                        f"{JSON_ARRAY_SUFFIXES[0]} to read it as an array of records, or write one record per line")


def _iter_json_array(path: str, data: bytes) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    """The elements of a file holding one JSON array; a file that does not parse is one DataError."""
    how = "a .json file starting with '[' is read as one JSON array of records"
    try:
        records = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise DataError(path, None, "invalid utf-8", f"byte {exc.start}: {exc.reason}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise DataError(path, None, "malformed json", f"{exc} ({how})") from None
    for number, record in enumerate(records, start=1):  # a parsed file that starts with '[' is a list
        if not isinstance(record, dict):
            record = DataError(path, number, "not an object", f"expected a JSON object, got {type(record).__name__}")
        yield number, record


def _parse_json_line(path: str, line_no: int, raw: bytes) -> dict[str, Any] | DataError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return DataError(path, line_no, "invalid utf-8", f"byte {exc.start}: {exc.reason}")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:  # its own "line 2 column 1" would contradict line_no
        end = len(text.rstrip("\r\n"))
        where = "at the end of the line" if exc.pos >= end else f"at character {exc.pos + 1} of the line"
        return DataError(path, line_no, "malformed json", f"{exc.msg} {where}")
    except RecursionError as exc:
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


def read_files(paths: Iterable[str | os.PathLike], read: Callable[[str | os.PathLike], Iterable], *,
               policy: SkipPolicy, what: str) -> list:
    """Every item ``read(path)`` yields for each of ``paths`` in order (``read`` hands bad records to
    ``policy``). A file that holds no records at all when others do (a failed download among
    several files) is a DataError naming it; where every file is empty, :class:`LoadedRecords`
    says so."""
    items: list = []
    records_per_file = {}
    for path in paths:
        before = len(items) + policy.total()
        items.extend(read(path))
        records_per_file[os.fspath(path)] = len(items) + policy.total() - before
    empty = [path for path, n in records_per_file.items() if n == 0]
    if empty and len(empty) < len(records_per_file):
        kind = "empty data file" if len(empty) == 1 else "empty data files"
        raise DataError(", ".join(empty), None, kind,
                        f"no records to read (expected {what}; the other files hold records)")
    return items


class LoadedRecords:
    """Items loaded up front from local files, with per-reason skip counts.

    ``len(self) + sum(skipped.values())`` is the number of input records; an empty result is an
    error naming the files (``what`` says what was expected).
    """

    def __init__(self, paths: list[str], items: list, skipped: collections.Counter, *, what: str) -> None:
        if not items and not skipped:
            kind = "empty data file" if len(paths) == 1 else "empty data files"
            raise DataError(", ".join(paths), None, kind, f"no records to read (expected {what})")
        if not items:
            raise DataError(", ".join(paths), None, f"no usable {what}", f"skipped: {dict(skipped)}")
        self.paths = paths
        self.items = items
        self.skipped = skipped

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]

    @functools.cached_property
    def content_sha256(self) -> str:
        """SHA-256 of the files' bytes in order (not of their paths: a moved copy is the same data).
        A checkpoint records it, so a resume can tell that its data position meets other records."""
        digest = hashlib.sha256()
        for path in self.paths:
            digest.update(os.path.getsize(path).to_bytes(8, "little"))
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()
