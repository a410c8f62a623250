"""Sample order: pure epoch permutations, resumable position, data-parallel slices."""

from __future__ import annotations

import pytest

from megatron_prune.data.sampler import EpochSampler, dp_shard, epoch_permutation


def test_epoch_permutation_is_a_pure_function():
    order = epoch_permutation(100, seed=1234, epoch=3)
    assert sorted(order) == list(range(100))
    assert order == epoch_permutation(100, seed=1234, epoch=3)
    assert order != epoch_permutation(100, seed=1234, epoch=4)
    assert order != epoch_permutation(100, seed=1235, epoch=3)
    assert epoch_permutation(0, seed=1, epoch=0) == []
    # Pinned values: the order must not change with library versions (resumed runs rely on it).
    assert epoch_permutation(10, seed=0, epoch=0) == [0, 7, 3, 1, 9, 5, 4, 6, 8, 2]


def _splitmix64(x: int) -> int:
    """Reference finaliser in Python integers (https://prng.di.unimi.it/splitmix64.c)."""
    mask = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


@pytest.mark.parametrize("seed, epoch", [(0, 0), (1234, 7), (2**63 + 5, 2), (-1, 1)])
def test_epoch_permutation_matches_the_integer_reference(seed, epoch):
    mask = (1 << 64) - 1
    base = _splitmix64(_splitmix64(seed & mask) ^ epoch)
    keys = [_splitmix64((i + base) & mask) for i in range(257)]
    assert epoch_permutation(257, seed=seed, epoch=epoch) == sorted(range(257), key=lambda i: keys[i])


def test_sampler_walks_epochs_without_dropping():
    sampler = EpochSampler(7, seed=5)
    first = sampler.next_indices(5) + sampler.next_indices(5)  # crosses into epoch 1
    assert first[:7] == epoch_permutation(7, seed=5, epoch=0)
    assert first[7:] == epoch_permutation(7, seed=5, epoch=1)[:3]
    assert (sampler.epoch, sampler.position) == (1, 3)
    assert EpochSampler(4, seed=5, shuffle=False).next_indices(6) == [0, 1, 2, 3, 0, 1]


def test_sampler_resumes_exactly():
    reference = EpochSampler(11, seed=9)
    expected = [reference.next_indices(4) for _ in range(10)]
    sampler = EpochSampler(11, seed=9)
    got = [sampler.next_indices(4) for _ in range(3)]
    state = sampler.state_dict()
    resumed = EpochSampler(11, seed=9)
    resumed.load_state_dict(state)
    got += [resumed.next_indices(4) for _ in range(7)]
    assert got == expected


@pytest.mark.parametrize("num_samples,count", [(10, 8), (7, 7), (11, 4), (9, 5), (5, 1)])
def test_distinct_requests_hold_no_index_twice_and_every_epoch_still_visits_each_once(num_samples, count):
    plain = EpochSampler(num_samples, seed=3).next_indices(count * 40)
    sampler = EpochSampler(num_samples, seed=3, distinct=True)
    seen = [0] * num_samples
    stream = []
    for _ in range(40):
        batch = sampler.next_indices(count)
        assert len(batch) == count and len(set(batch)) == count, batch
        stream += batch
        for i in batch:
            seen[i] += 1
        # At every request boundary no index is more than one visit ahead of another.
        assert max(seen) - min(seen) <= 1, seen
    assert sorted(stream[:num_samples]) == list(range(num_samples))  # the first epoch whole, first
    if num_samples % count == 0:  # never crossing an epoch inside a request: exactly the plain order
        assert stream == plain


def test_a_distinct_request_crossing_an_epoch_defers_the_repeat_to_the_next_request():
    sampler = EpochSampler(10, seed=1234, distinct=True)
    first, second = sampler.next_indices(8), sampler.next_indices(8)
    assert second[:2] == epoch_permutation(10, seed=1234, epoch=0)[8:]
    assert len(set(second)) == 8
    deferred = [i for i in epoch_permutation(10, seed=1234, epoch=1)[:8] if i in second[:2]]
    assert sampler.deferred == deferred
    third = sampler.next_indices(8)
    assert third[: len(deferred)] == deferred
    with pytest.raises(ValueError, match="distinct"):
        EpochSampler(4, seed=0, distinct=True).next_indices(5)


def test_distinct_sampler_resumes_exactly_with_deferred_indices():
    reference = EpochSampler(10, seed=7, distinct=True)
    expected = [reference.next_indices(8) for _ in range(12)]
    sampler = EpochSampler(10, seed=7, distinct=True)
    got = [sampler.next_indices(8) for _ in range(2)]
    state = sampler.state_dict()
    assert state["deferred"], "this test needs a position with deferred indices"
    resumed = EpochSampler(10, seed=7, distinct=True)
    resumed.load_state_dict(state)
    got += [resumed.next_indices(8) for _ in range(10)]
    assert got == expected
    legacy = {k: v for k, v in EpochSampler(10, seed=7).state_dict().items() if k != "deferred"}
    EpochSampler(10, seed=7, distinct=True).load_state_dict(legacy)  # states saved before deferral load
    with pytest.raises(ValueError, match="deferred"):
        EpochSampler(10, seed=7, distinct=True).load_state_dict({**state, "deferred": [10]})


def test_a_resume_that_turns_distinct_off_serves_the_deferred_indices_first():
    """DPO asks for distinct indices only while the data holds a global batch; a resume at a larger
    --global-batch-size turns that off. The indices a distinct request deferred are still due in
    their epoch: each of the first two epochs visits every sample exactly once, and no stale
    deferral is saved again."""
    sampler = EpochSampler(6, seed=1234, distinct=True)
    served = sampler.next_indices(4) + sampler.next_indices(4)
    state = sampler.state_dict()
    assert state["deferred"], "this test needs a position with deferred indices"
    resumed = EpochSampler(6, seed=1234, distinct=False)
    resumed.load_state_dict(state)
    served += resumed.next_indices(4)
    assert sorted(served[:6]) == sorted(served[6:12]) == list(range(6)), served
    assert resumed.state_dict()["deferred"] == []


def test_sampler_refuses_a_mismatched_state():
    state = EpochSampler(11, seed=9).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        EpochSampler(12, seed=9).load_state_dict(state)
    # A saved position in the shuffled order means another sample in the file's own order.
    with pytest.raises(ValueError, match="saved shuffle=True but this run has shuffle=False"):
        EpochSampler(11, seed=9, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        EpochSampler(11, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        EpochSampler(11, seed=9).load_state_dict({**state, "position": 11})
    with pytest.raises(ValueError, match="at least one"):
        EpochSampler(0, seed=9)


def test_dp_shard():
    batch = list(range(8))
    assert [dp_shard(batch, dp_rank=r, dp_size=4) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_shard(batch, dp_rank=0, dp_size=1) == batch
    with pytest.raises(ValueError, match="does not split evenly"):
        dp_shard(batch, dp_rank=0, dp_size=3)
    with pytest.raises(ValueError, match="dp_rank"):
        dp_shard(batch, dp_rank=4, dp_size=4)
