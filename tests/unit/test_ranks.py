"""Which rank speaks: torchrun's global rank 0 only, not the first rank of every node."""

from __future__ import annotations

import pytest

from megatron_prune.ranks import first_rank


@pytest.mark.parametrize(
    ("rank", "local_rank", "expected"),
    [("0", "0", True), ("8", "0", False), ("9", "1", False), (None, None, True)],
)
def test_first_rank_is_the_global_rank_0(monkeypatch, rank, local_rank, expected):
    """Rank 8 is local rank 0 of the second node: it stays quiet. Without a launcher the process speaks."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert first_rank() is expected
