"""Every rank must read the same data: nodes with another copy of a file at the same path trained
on other data without a word (the flags, compared already, were the same)."""

from __future__ import annotations

import pytest

from tests.dist import run_distributed


def check(digests: list[dict]) -> str:
    import torch.distributed as dist

    from megatron_prune.arguments import UsageError
    from megatron_prune.training.parallel import initialize_distributed
    from megatron_prune.training.session import check_same_data

    initialize_distributed()
    try:
        check_same_data(digests[dist.get_rank()])
    except UsageError as exc:
        return str(exc)
    return "same"


@pytest.mark.distributed
def test_a_rank_that_read_other_data_stops_every_rank():
    same = {"--data-path": "aa", "--eval-data-path": None}
    assert run_distributed(check, 2, digests=[same, dict(same)]) == ["same", "same"]
    other = {"--data-path": "bb", "--eval-data-path": None}
    message = ("rank 1 read other data than rank 0 for --data-path: the files at that path differ between its node "
               "and rank 0's; give every node the same files")
    assert run_distributed(check, 2, digests=[same, other]) == [message, message]
