"""Packed rows -> THD ``PackedSeqParams`` -> the ``actual_seq_qlen`` of MindSpeed's TND attention."""

from __future__ import annotations

import pytest
import torch

from megatron_prune.adapters import mindspeed as adapter
from megatron_prune.data.packing import pack_sequences, pack_tensors
from megatron_prune.patches.mindspeed_compat import _thd_cu_seqlens_for_npu, npu_actual_seq_len, to_npu_packed_seq_params

LENGTHS = [5, 3, 7, 2, 6, 4, 1]
CAPACITY = 10


@pytest.fixture
def plan():
    return pack_sequences(LENGTHS, capacity=CAPACITY, window=4)


def test_cu_seqlens_cover_the_flattened_rows(plan):
    cu = adapter.thd_cu_seqlens(plan.rows)
    assert cu.dtype == torch.int32 and int(cu[0]) == 0
    assert int(cu[-1]) == plan.num_rows * CAPACITY
    assert bool((cu[1:] > cu[:-1]).all())


def test_each_segment_is_one_sequence_or_one_rows_padding(plan):
    batch = pack_tensors(plan, [torch.full((n,), i + 1) for i, n in enumerate(LENGTHS)])
    flat_segments = (batch.segment_ids + 100 * torch.arange(plan.num_rows)[:, None]).reshape(-1)
    flat_positions = batch.position_ids.reshape(-1)
    cu = adapter.thd_cu_seqlens(plan.rows).tolist()
    assert len(cu) - 1 == len(LENGTHS) + sum(1 for row in plan.rows if row.padding)
    for start, end in zip(cu, cu[1:]):
        assert len(set(flat_segments[start:end].tolist())) == 1  # one sequence (or padding) per segment
        assert flat_positions[start:end].tolist() == list(range(end - start))  # positions restart


def test_real_packed_seq_params(plan):
    params = adapter.thd_packed_seq_params(plan.rows)
    from megatron.core.packed_seq_params import PackedSeqParams

    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    assert torch.equal(params.cu_seqlens_q, adapter.thd_cu_seqlens(plan.rows))
    assert params.max_seqlen_q == params.max_seqlen_kv == max(max(LENGTHS), max(r.padding for r in plan.rows))
    converted = to_npu_packed_seq_params(params)
    assert isinstance(converted, PackedSeqParams)
    assert converted.cu_seqlens_q.dtype == torch.int32  # MindSpeed calls .tolist() on it
    assert converted.cu_seqlens_q.tolist() == params.cu_seqlens_q.tolist()[1:]
    assert params.cu_seqlens_q.tolist()[0] == 0  # not modified


@pytest.mark.parametrize(
    ("cu", "expected"),
    [([0, 3, 7, 10], [3, 7, 10]), (torch.tensor([0, 4], dtype=torch.int32), [4]), ([3, 7, 10], [3, 7, 10])],
)
def test_npu_actual_seq_len(cu, expected):
    assert npu_actual_seq_len(cu) == expected
    assert adapter.npu_actual_seq_len(cu) == expected


@pytest.mark.parametrize("cu", [[0, 0, 3], [0, 5, 4], [0, 3, 3]])
def test_empty_or_decreasing_segments_are_refused(cu):
    with pytest.raises(ValueError, match="strictly increasing"):
        npu_actual_seq_len(cu)


class _Params:
    def __init__(self, fmt="thd", cu=None, padded=None):
        self.qkv_format = fmt
        self.cu_seqlens_q = self.cu_seqlens_kv = cu
        self.cu_seqlens_q_padded = self.cu_seqlens_kv_padded = padded


def test_non_thd_and_absent_params_pass_unchanged():
    assert to_npu_packed_seq_params(None) is None
    sbhd = _Params(fmt="sbhd", cu=torch.tensor([0, 4]))
    assert to_npu_packed_seq_params(sbhd) is sbhd
    npu_form = _Params(cu=torch.tensor([4, 9]))
    assert to_npu_packed_seq_params(npu_form) is npu_form


def test_padded_offsets_win():
    # With per-sequence padding the kernel must see where sequences lie in the packed tensor.
    params = _Params(cu=torch.tensor([0, 3, 5]), padded=torch.tensor([0, 4, 8]))
    converted = to_npu_packed_seq_params(params)
    assert converted.cu_seqlens_q.tolist() == converted.cu_seqlens_kv.tolist() == [4, 8]
    assert converted.cu_seqlens_q_padded is None


def test_wrapper_leaves_calls_without_thd_alone():
    seen = []

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        seen.append(packed_seq_params)
        return "out"

    wrapped = _thd_cu_seqlens_for_npu(forward)
    assert wrapped(None, 1, 2, 3, None) == "out" and seen == [None]
    params = _Params(cu=torch.tensor([0, 2, 6]))
    wrapped(None, 1, 2, 3, None, packed_seq_params=params)
    assert seen[-1] is not params and seen[-1].cu_seqlens_q.tolist() == [2, 6]
