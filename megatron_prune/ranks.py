"""Which process speaks: every rank runs the same checks and reads the same data, one says so."""

from __future__ import annotations

import os


def first_rank() -> bool:
    """This process is torchrun's rank 0, or runs without a launcher (valid before and after the
    process group starts: torchrun's RANK is the global rank)."""
    return int(os.environ.get("RANK", "0")) == 0
