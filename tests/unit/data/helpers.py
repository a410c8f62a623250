"""Helpers for the data tests."""

from __future__ import annotations

import json


def write_jsonl(path, records) -> str:
    """Write records (dicts as JSON, bytes verbatim) one per line; return the path."""
    with open(path, "wb") as handle:
        for record in records:
            line = record if isinstance(record, bytes) else json.dumps(record, ensure_ascii=False).encode("utf-8")
            handle.write(line + b"\n")
    return str(path)
