"""Segment layouts and segment attention against a dense masked reference.

The reference is plain attention written here: ``softmax(Q K^T / sqrt(d) + mask) V`` in float64
over every (query, key) pair of a row, with the allowed pairs spelled out from the rule "a query
sees its own segment's keys up to itself and its segment's prefix; a padding position sees only
itself". Random layouts cover shared prompts with several responses, several groups per row,
empty and one-token responses, padding between and after segments, and grouped-query heads;
outputs and the gradients of q, k and v are compared. Negative controls: a layout in which the
rejected response also sees the chosen one (and one that drops the prefix of later segments)
gives a different result, and the comparison catches it.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.testing import assert_close

import megatron_prune.model.segment_attention as segment_attention_module
from megatron_prune.model.segment_attention import is_segment_table, segment_attention
from megatron_prune.model.segments import Segment, SegmentLayout

TOL = dict(rtol=1e-5, atol=1e-5)


def allowed_pairs(rows: list[list[Segment]], s: int) -> torch.Tensor:
    """``[b, s, s]`` bool, True where query i may attend to key j (written from the rule)."""
    allowed = torch.zeros(len(rows), s, s, dtype=torch.bool)
    for r, row in enumerate(rows):
        owner = {}
        for seg in row:
            for i in range(seg.start, seg.end):
                owner[i] = seg
        for i in range(s):
            seg = owner.get(i)
            for j in range(s):
                if seg is None:
                    allowed[r, i, j] = i == j
                else:
                    allowed[r, i, j] = (seg.start <= j <= i) or (seg.prefix_start <= j < seg.prefix_end)
    return allowed


def reference_attention(q, k, v, allowed):
    """q [s, b, np, d], k/v [s, b, ng, d], allowed [b, s, s] -> [s, b, np*d] (float64 math)."""
    s, b, np_, d = q.shape
    rep = np_ // k.shape[2]
    q64, k64, v64 = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    k64, v64 = k64.repeat_interleave(rep, dim=1), v64.repeat_interleave(rep, dim=1)
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = scores.softmax(-1) @ v64  # [b, np, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, np_ * d)


def random_layout(rng: random.Random, *, b: int, s: int) -> SegmentLayout:
    """Rows of groups ``[prompt, r1, ..., rk]`` (responses see the prompt), with gaps of padding."""
    rows = []
    for _ in range(b):
        row, pos = [], 0
        while pos < s - 1:
            pos += rng.choice([0, 0, 1, 2])  # padding between groups
            prompt = rng.randint(1, 6)
            if pos + prompt > s:
                break
            row.append(Segment(pos, pos + prompt))
            p0, pos = pos, pos + prompt
            for _ in range(rng.randint(0, 3)):
                n = rng.choice([0, 1, 1, 2, 3, 5])
                if pos + n > s:
                    break
                row.append(Segment(pos, pos + n, p0, p0 + prompt))
                pos += n
        rows.append(row)
    return SegmentLayout(rows=rows, seq_length=s)


def qkv(s, b, np_, ng, d, seed):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(s, b, h, d, generator=gen).requires_grad_()  # noqa: E731
    return make(np_), make(ng), make(ng)


def run(fn, q, k, v):
    out = fn(q, k, v)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    return out, grads


def compare(layout: SegmentLayout, reference_rows: list[list[Segment]], *, np_=4, ng=2, d=8, seed=0):
    s, b = layout.seq_length, layout.batch_size
    q, k, v = qkv(s, b, np_, ng, d, seed)
    got, got_grads = run(lambda *t: segment_attention(*t, layout.to_table()), q, k, v)
    allowed = allowed_pairs(reference_rows, s)
    want, want_grads = run(lambda *t: reference_attention(*t, allowed), q, k, v)
    assert_close(got.double(), want, **TOL)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert_close(g.double(), w.double(), **TOL, msg=f"grad {name}")


def shared_pair_layout(p=5, c=3, r=4, s=16):
    return SegmentLayout(rows=[[Segment(0, p), Segment(p, p + c, 0, p), Segment(p + c, p + c + r, 0, p)]], seq_length=s)


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_equal_dense_reference(seed):
    rng = random.Random(seed)
    b, s = rng.randint(1, 3), rng.choice([8, 16, 24])
    np_, ng = rng.choice([(4, 2), (4, 4), (6, 1)])
    layout = random_layout(rng, b=b, s=s)
    compare(layout, layout.rows, np_=np_, ng=ng, seed=seed)


def test_shared_pair_with_empty_and_one_token_responses():
    rows = [[Segment(0, 4), Segment(4, 4, 0, 4), Segment(4, 5, 0, 4)],  # empty chosen, one-token rejected
            [Segment(0, 1), Segment(1, 2, 0, 1), Segment(2, 8, 0, 1), Segment(9, 12)]]
    layout = SegmentLayout(rows=rows, seq_length=12)
    compare(layout, rows)


def test_all_padding_row_and_no_segments():
    layout = SegmentLayout(rows=[[], [Segment(2, 5)]], seq_length=8)
    compare(layout, layout.rows)


def test_dense_mask_is_the_reference_semantics():
    rng = random.Random(3)
    for _ in range(5):
        layout = random_layout(rng, b=2, s=16)
        assert torch.equal(layout.dense_mask(), ~allowed_pairs(layout.rows, 16)[:, None])


def test_rejected_seeing_chosen_is_caught():
    """Negative control: rejected's prefix wrongly covers chosen; the reference must disagree."""
    right = shared_pair_layout()
    wrong = SegmentLayout(rows=[[Segment(0, 5), Segment(5, 8, 0, 5), Segment(8, 12, 0, 8)]], seq_length=16)
    compare(right, right.rows)
    with pytest.raises(AssertionError):
        compare(wrong, right.rows)


def test_later_segments_without_prefix_are_caught():
    """Negative control: a response that lost its prompt keys differs from the reference."""
    right = shared_pair_layout()
    wrong = SegmentLayout(rows=[[Segment(0, 5), Segment(5, 8, 0, 5), Segment(8, 12)]], seq_length=16)
    with pytest.raises(AssertionError):
        compare(wrong, right.rows)


def test_padded_groups_do_not_mix_segments_of_different_lengths():
    """Many segments of very different lengths in one row (several padded groups)."""
    rows = [[Segment(0, 1), Segment(1, 3), Segment(3, 30), Segment(30, 31, 3, 30), Segment(31, 40, 0, 1)]]
    compare(SegmentLayout(rows=rows, seq_length=40), rows)


def test_prompt_and_its_first_response_run_as_one_causal_segment():
    """A prefix-less segment and the segment that continues it directly join into one causal
    segment, which runs without a mask; the later responses on the same prompt keep it as prefix."""
    layout = shared_pair_layout()
    plan = segment_attention_module._build_plan(layout, torch.device("cpu"))
    unmasked = [g for g in plan.groups if g.allowed is None]
    assert len(unmasked) == 1 and unmasked[0].q_valid.sum().item() == 8, "[prompt, chosen] did not join"
    assert all(g.allowed is not None for g in plan.groups if g is not unmasked[0])
    compare(layout, layout.rows)


def test_a_response_after_padding_does_not_join_its_prompt():
    """Negative control of the join: a response that does not start where its prompt ends keeps
    the prompt as its prefix (joining would let it see the padding between them)."""
    rows = [[Segment(0, 4), Segment(6, 9, 0, 4), Segment(9, 11, 0, 4)], [Segment(1, 3), Segment(3, 7, 1, 3)]]
    layout = SegmentLayout(rows=rows, seq_length=12)
    compare(layout, rows)
    plan = segment_attention_module._build_plan(layout, torch.device("cpu"))
    assert sum(int(g.q_valid.sum()) for g in plan.groups if g.allowed is None) == 4 + 6  # row 0's prompt, row 1's pair


def flash_varlen_emulator(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal):
    """flash_attn_varlen_func's documented semantics in PyTorch: causal aligned bottom-right."""
    assert causal and dropout_p == 0.0
    out = []
    rep = q.shape[1] // k.shape[1]
    for n in range(len(cu_q) - 1):
        qs, ks = q[cu_q[n] : cu_q[n + 1]], k[cu_k[n] : cu_k[n + 1]]
        vs = v[cu_k[n] : cu_k[n + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        assert lq <= max_q and lk <= max_k
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        scores = scores.masked_fill(j > i + (lk - lq), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    return torch.cat(out)


def use_flash_emulator(monkeypatch) -> list:
    """Route segment attention to the flash path with the emulated kernel; returns a list that
    grows by one per kernel call, so a test can check the flash path really ran."""
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flash_varlen_emulator(*args, **kwargs)

    monkeypatch.setattr(segment_attention_module, "_flash_for", lambda query, deterministic=False: counted)
    return calls


def test_flash_path_inputs(monkeypatch):
    """The GPU path's gathered queries/keys and cu_seqlens, run through a PyTorch emulation of
    flash_attn_varlen_func (the kernel itself needs a GPU)."""
    calls = use_flash_emulator(monkeypatch)
    for seed in range(4):
        layout = random_layout(random.Random(100 + seed), b=2, s=16)
        before = len(calls)
        compare(layout, layout.rows, seed=seed)
        assert len(calls) > before, "the flash path did not run"


def test_table_round_trip_and_detection():
    layout = shared_pair_layout()
    table = layout.to_table()
    assert is_segment_table(table) and not is_segment_table(layout.dense_mask()) and not is_segment_table(None)
    assert SegmentLayout.from_table(table, seq_length=16) == layout


@pytest.mark.parametrize(
    "rows, message",
    [
        ([[Segment(0, 5), Segment(4, 8)]], "overlap"),
        ([[Segment(0, 17)]], "inside"),
        ([[Segment(3, 6, 0, 4)]], "prefix must end"),
        ([[Segment(3, 6, 2, 1)]], "prefix that ends before"),
    ],
)
def test_invalid_layouts_are_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        SegmentLayout(rows=rows, seq_length=16)


def test_attention_pairs_count_the_real_work():
    p, c, r = 5, 3, 4
    assert shared_pair_layout(p, c, r, s=16).attention_pairs() == (
        p * (p + 1) // 2 + c * p + c * (c + 1) // 2 + r * p + r * (r + 1) // 2 + (16 - p - c - r)
    )


def test_bf16_inputs_track_the_reference():
    layout = random_layout(random.Random(5), b=2, s=24)
    q, k, v = (t.detach().to(torch.bfloat16) for t in qkv(24, 2, 4, 2, 8, seed=5))
    got = segment_attention(q, k, v, layout.to_table())
    assert got.dtype == torch.bfloat16
    want = reference_attention(q.float(), k.float(), v.float(), allowed_pairs(layout.rows, 24))
    assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def keys_only_case(seed: int, *, b: int):
    """A layout whose first ``n`` positions are keys only (no segment there): the segments after
    them take prefixes from that region, as a forward on stored keys and values does."""
    rng = random.Random(seed)
    n, s = rng.randint(3, 9), 24
    stored = [Segment(0, n)]  # what the reference sees in front: a causal run of keys
    rows, reference_rows = [], []
    for _ in range(b):
        row, pos = [], n
        while pos < s - 1:
            length = rng.choice([1, 2, 3, 5])
            if pos + length > s:
                break
            p0 = rng.randint(0, n - 1)
            row.append(Segment(pos, pos + length, p0, rng.randint(p0 + 1, n)))
            pos += length + rng.choice([0, 0, 1])
        rows.append(row)
        reference_rows.append(stored + row)
    return n, SegmentLayout(rows=rows, seq_length=s), reference_rows


@pytest.mark.parametrize("flash", [False, True])
def test_positions_before_the_queries_are_keys_only(flash, monkeypatch):
    """``query`` covers only the last positions; the earlier ones are keys that segments take as
    their prefix. Each query row equals the full computation's row at the same position."""
    calls = use_flash_emulator(monkeypatch) if flash else None
    for seed in range(6):
        b = 1 + seed % 2
        n, layout, reference_rows = keys_only_case(seed, b=b)
        s = layout.seq_length
        q, k, v = qkv(s, b, 4, 2, 8, seed)
        got, got_grads = run(lambda q_, k_, v_: segment_attention(q_[n:], k_, v_, layout.to_table()), q, k, v)
        assert got.shape == (s - n, b, 32)
        want, want_grads = run(lambda *t: reference_attention(*t, allowed_pairs(reference_rows, s))[n:], q, k, v)
        assert_close(got.double(), want, **TOL)
        for name, g, w in zip("qkv", got_grads, want_grads):
            assert_close(g.double(), w.double(), **TOL, msg=f"grad {name}")
    assert calls is None or calls, "the flash path did not run"


class _CudaQuery:
    """What _flash_for reads of a query on a GPU (none is needed to decide)."""

    is_cuda = True
    dtype = torch.bfloat16
    device = "cuda:0"

    def __init__(self, head_size=64):
        self.shape = (8, 1, 4, head_size)


@pytest.mark.parametrize(
    "version, capability, head_size, deterministic, uses_flash",
    [("2.6.3", (9, 0), 128, False, True), ("2.0.9", (9, 0), 128, False, False), ("2.6.3", (7, 5), 128, False, False),
     ("2.6.3", (8, 0), 320, False, False), ("2.3.6", (9, 0), 128, True, False), ("2.4.1", (9, 0), 128, True, True),
     ("2.5.0", (8, 6), 256, False, False), ("2.5.0", (8, 0), 256, False, True), ("2.5.5", (8, 6), 256, False, True)],
)
def test_flash_only_where_its_causal_rule_and_the_gpu_fit(monkeypatch, version, capability, head_size, deterministic,
                                                          uses_flash):
    """flash-attn before 2.1 aligns the causal mask top-left when a segment has fewer queries than
    keys; flash-attn 2 refuses pre-Ampere GPUs and heads over 256, takes ``deterministic`` from
    2.4.1, and runs the backward of heads over 192 off A100/H100 from 2.5.5."""
    import importlib.util
    import sys
    import types

    kernel = object()
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__=version, flash_attn_varlen_func=kernel))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got = segment_attention_module._flash_for(_CudaQuery(head_size), deterministic=deterministic)
    assert (got is kernel) == uses_flash


def test_recomputed_layers_reuse_the_plan(monkeypatch):
    """Activation recomputation hands each layer a detached copy of the table: still one plan."""
    built = []
    real = segment_attention_module._build_plan
    monkeypatch.setattr(segment_attention_module, "_build_plan", lambda *a, **k: built.append(1) or real(*a, **k))
    monkeypatch.setattr(segment_attention_module, "_plan_cache", {"key": None, "table": None, "plan": None})
    table = shared_pair_layout().to_table()
    q = torch.randn(16, 1, 4, 8)
    kv = torch.randn(16, 1, 2, 8)
    first = segment_attention(q, kv, kv, table)
    for _ in range(3):
        assert torch.equal(segment_attention(q, kv, kv, table.detach()), first)
    assert len(built) == 1
    segment_attention(q, kv, kv, table.clone())  # another microbatch's table: a new plan
    assert len(built) == 2


def test_deterministic_mode_reaches_the_flash_kernel(monkeypatch):
    seen = []

    def kernel(*args, **kwargs):
        seen.append(kwargs.get("deterministic", False))
        return flash_varlen_emulator(*args, **{k: v for k, v in kwargs.items() if k != "deterministic"})

    monkeypatch.setattr(segment_attention_module, "_flash_for", lambda query, deterministic=False: kernel)
    table = shared_pair_layout().to_table()
    q, kv = torch.randn(16, 1, 4, 8), torch.randn(16, 1, 2, 8)
    segment_attention(q, kv, kv, table)
    segment_attention(q, kv, kv, table, deterministic=True)
    assert seen == [False, True]
