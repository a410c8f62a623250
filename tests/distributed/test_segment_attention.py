"""Shared rows through the model: ``segments=`` equals separate rows, at every parallel layout.

A shared row ``[prompt, chosen, rejected]`` with its :class:`SegmentLayout` and per-token
position ids (rejected continues from the prompt's end) must give the log-probs of two separate
rows ``[prompt, chosen]`` and ``[prompt, rejected]``, and the gradient of a weighted sum of them
(the prompt is run once but feeds both responses). Everything runs through Megatron's schedule
with the selective head, as the trainers do. Negative control: the same shared row with the
right mask but row-index rotary positions (no ``segments``) must differ.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

SEED = 1234
VOCAB = 512
# fp32 on CPU: the shared and separate rows reduce in different orders; agreement is ~1e-7.
TOL = dict(rtol=1e-5, atol=1e-5)

# (prompt, chosen, rejected) lengths of each pair; micro-batches of two pairs.
PAIRS = [
    [(7, 5, 4), (5, 1, 6)],   # a one-token chosen response
    [(9, 3, 0), (4, 6, 5)],   # an empty rejected response
]
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "pp2-vpp2": dict(pp=2, vpp=2),
}


def _round_up(n: int, multiple: int = 8) -> int:
    return -(-n // multiple) * multiple


def _pair_tokens(index: int, lengths: tuple[int, int, int]) -> tuple[list[int], list[int], list[int]]:
    gen = torch.Generator().manual_seed(SEED + index)
    return tuple(torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths)


def _weights(n: int, index: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(10 * SEED + index)) + 0.5


def shared_batch(pairs: list[tuple[int, int, int]], first: int, *, with_segments: bool = True) -> dict:
    """One row per pair; scored: chosen then rejected tokens of each pair, in pair order."""
    from megatron_prune.model.segments import Segment, SegmentLayout

    s = _round_up(max(sum(p) for p in pairs))
    b = len(pairs)
    tokens = torch.zeros(b, s, dtype=torch.long)
    positions = torch.arange(s).repeat(b, 1)
    rows, index, labels = [], [], []
    for r, lengths in enumerate(pairs):
        prompt, chosen, rejected = _pair_tokens(first + r, lengths)
        p, c, n = lengths
        tokens[r, : p + c + n] = torch.tensor(prompt + chosen + rejected)
        positions[r, p + c : p + c + n] = torch.arange(p, p + n)
        rows.append([Segment(0, p), Segment(p, p + c, 0, p), Segment(p + c, p + c + n, 0, p)])
        # Response token k is predicted at the position before it; the first one from the prompt's end.
        for start, response in ((p, chosen), (p + c, rejected)):
            for k, token in enumerate(response):
                index.append((p - 1 if k == 0 else start + k - 1) * b + r)
                labels.append(token)
    layout = SegmentLayout(rows=rows, seq_length=s)
    return dict(tokens=tokens, positions=positions, index=torch.tensor(index), labels=torch.tensor(labels),
                segments=layout if with_segments else None,
                mask=None if with_segments else layout.dense_mask())


def separate_batch(pairs: list[tuple[int, int, int]], first: int) -> dict:
    """Rows ``[prompt, chosen]`` for every pair, then ``[prompt, rejected]``; same scored order."""
    s = _round_up(max(p + max(c, n) for p, c, n in pairs))
    b = 2 * len(pairs)
    tokens = torch.zeros(b, s, dtype=torch.long)
    scored = []
    for r, lengths in enumerate(pairs):
        prompt, chosen, rejected = _pair_tokens(first + r, lengths)
        p = lengths[0]
        for row, response in ((r, chosen), (len(pairs) + r, rejected)):
            tokens[row, : p + len(response)] = torch.tensor(prompt + response)
            scored.append([((p - 1 + k) * b + row, token) for k, token in enumerate(response)])
    order = [scored[2 * r + j] for r in range(len(pairs)) for j in (0, 1)]
    flat = [entry for chunk in order for entry in chunk]
    return dict(tokens=tokens, positions=torch.arange(s).repeat(b, 1), index=torch.tensor([i for i, _ in flat]),
                labels=torch.tensor([t for _, t in flat]), segments=None, mask=None)


def _forward_step(data_iterator, model):
    from functools import partial

    from megatron_prune.model.selective_gpt import TokenSelection

    batch = next(data_iterator)
    selection = TokenSelection(index=batch["index"], labels=batch["labels"], seq_ids=torch.zeros_like(batch["index"]))
    output = model(batch["tokens"], batch["positions"], batch["mask"], token_selection=selection,
                   segments=batch["segments"])
    return output, partial(_loss, batch)


def _loss(batch, logps):
    loss = (logps * batch["weights"]).sum()
    return loss, {"logps": logps.detach().clone()}


def run_batches(batches: list[dict], *, tp=1, pp=1, vpp=None, sp=False, recompute=False) -> dict:
    """Log-probs of every microbatch and the whole gradient of the weighted sum, at one layout."""
    from megatron.core import parallel_state

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import forward_backward

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp, recompute=recompute)
    with model_parallel(parallel, seed=SEED):
        model = setup_model(get_preset("tiny"), parallel, seed=SEED)
        segment_path = [chunk.module._segment_attention_in_spec() for chunk in model]
        optimizer = build_optimizer(model, OptimConfig(optimizer="sgd", lr=0.1), bf16=False)
        for k, batch in enumerate(batches):
            batch["weights"] = _weights(batch["index"].numel(), k)
        outputs = forward_backward(
            model=model, optimizer=optimizer, forward_step_func=_forward_step,
            data_iterator=iter(batches) if vpp is None else [iter(batches) for _ in range(vpp)],
            num_microbatches=len(batches), seq_length=batches[0]["tokens"].shape[1],
            micro_batch_size=batches[0]["tokens"].shape[0],
        )
        grads = gather_global_state(model, source="main_grad")
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return dict(logps=[o["logps"] for o in outputs] if last else None, grads=grads, segment_path=segment_path)


def _single_batches(kind: str) -> list[dict]:
    build = {"shared": shared_batch, "separate": separate_batch,
             "row_index_rope": lambda pairs, first: shared_batch(pairs, first, with_segments=False)}[kind]
    return [build(pairs, 10 * k) for k, pairs in enumerate(PAIRS)]


def core_attention_bit_identity() -> dict:
    """SegmentAttention without a segment table against Megatron's DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig, transformer_config
    from megatron_prune.model.segment_attention import SegmentAttention
    from megatron_prune.training.parallel import model_parallel

    parallel = ParallelConfig()
    results = {}
    with model_parallel(parallel, seed=SEED):
        config = transformer_config(get_preset("tiny"), parallel)
        modules = [cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
                   for cls in (DotProductAttention, SegmentAttention)]
        gen = torch.Generator().manual_seed(SEED)
        s, b = 16, 2
        q = torch.randn(s, b, 4, 16, generator=gen)
        k, v = torch.randn(2, s, b, 2, 16, generator=gen)
        packed = torch.ones(s, s, dtype=torch.bool).tril()
        packed[8:, :8] = False
        for name, mask in (("causal", ~torch.ones(1, 1, s, s, dtype=torch.bool).tril()),
                           ("packed", (~packed).expand(b, 1, s, s))):
            outs = [m(q, k, v, mask, attn_mask_type=AttnMaskType.causal) for m in modules]
            results[name] = torch.equal(*outs)
    return results


def refusals() -> list[str]:
    """Messages of the model's refusals: a mask and segments together; position ids of another shape."""
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    batch = _single_batches("shared")[0]
    messages = []
    with model_parallel(ParallelConfig(), seed=SEED):
        model = setup_model(get_preset("tiny"), ParallelConfig(), seed=SEED, trainable=False)[0]
        for mask, positions in ((batch["segments"].dense_mask(), batch["positions"]),
                                (None, batch["positions"][:, :-1])):
            try:
                model(batch["tokens"], positions, mask, segments=batch["segments"])
            except ValueError as exc:
                messages.append(str(exc))
    return messages


def single_rank() -> dict:
    results = {kind: run_batches(_single_batches(kind)) for kind in ("shared", "separate", "row_index_rope")}
    results["refusals"] = refusals()
    results["recompute"] = run_batches(_single_batches("shared"), recompute=True)
    results["bit_identity"] = core_attention_bit_identity()
    return results


def two_ranks() -> dict:
    # Under PP every microbatch must have one shape: the tests' pairs are padded to the same length.
    return {name: run_batches(_single_batches("shared"), **layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def single():
    return run_distributed(single_rank, 1)[0]


def assert_same(got: dict, want: dict) -> None:
    for a, b in zip(got["logps"], want["logps"], strict=True):
        assert_close(a, b, **TOL)
    assert got["grads"].keys() == want["grads"].keys()
    for name in want["grads"]:
        assert_close(got["grads"][name], want["grads"][name], **TOL, msg=name)


def test_shared_row_equals_separate_rows(single):
    assert all(single["shared"]["segment_path"]), "the local spec's core attention must take the segment table"
    assert_same(single["shared"], single["separate"])


def test_shared_row_with_recomputation(single):
    assert_same(single["recompute"], single["separate"])


def test_bad_segment_inputs_are_refused(single):
    mask_and_segments, wrong_positions = single["refusals"]
    assert "either an attention_mask or segments" in mask_and_segments
    assert "position_ids are" in wrong_positions


def test_segment_attention_without_segments_is_megatrons(single):
    assert single["bit_identity"] == {"causal": True, "packed": True}


def test_row_index_rope_is_caught(single):
    """Negative control: the right mask with row-index rotary positions scores rejected differently."""
    got, want = single["row_index_rope"]["logps"], single["separate"]["logps"]
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) > 1e-3


@pytest.fixture(scope="module")
def parallel_results():
    return run_distributed(two_ranks, 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_row_at_layout_equals_single_rank(single, parallel_results, layout):
    for rank_result in parallel_results:
        got = rank_result[layout]
        assert all(got["segment_path"])
        assert got["grads"].keys() == single["shared"]["grads"].keys()
        for name, grad in single["shared"]["grads"].items():
            assert_close(got["grads"][name], grad, **TOL, msg=name)
    scored = [r[layout]["logps"] for r in parallel_results if r[layout]["logps"] is not None]
    assert scored, "no rank returned log-probs"
    for logps in scored:
        for a, b in zip(logps, single["separate"]["logps"], strict=True):
            assert_close(a, b, **TOL)
