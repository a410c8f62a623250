"""Both LM heads of ``SelectiveGPTModel`` against transformers' model with the same weights.

A tiny random Qwen3 HF model (untied and tied; vocabulary 300, padded to 1024) is loaded into
Megatron at TP=1, TP=2 and TP=2 with sequence parallelism (two gloo ranks, one launch). For a
selection that scores every position of one row and the last position of the other, the
selective head and the baseline head (``all_labels``: full-vocabulary logits, vocab-parallel cross
entropy) must both return ``log_softmax(logits_HF / T)[label]`` for no temperature, a scalar
temperature and a per-row temperature.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed
from tests.unit.model.hf_models import load_hf_model, make_hf_model

pytestmark = pytest.mark.distributed

B, S = 2, 16
LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "tp2-sp": (2, True)}
HEADS = ("selective", "baseline")
KINDS = ("qwen3", "qwen3-tied")


def _selection_rows():
    """(rows, positions): every position of row 1, then the last position of row 0."""
    rows = torch.tensor([1] * S + [0])
    positions = torch.tensor(list(range(S)) + [S - 1])
    return rows, positions


def _temperatures(n: int) -> dict:
    return {"none": None, "scalar": 0.7, "per-row": torch.linspace(0.5, 2.0, n)}


def _tokens_and_labels(vocab_size: int):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (B, S), generator=gen)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = 7  # a label at the last position, as a packed row's next segment would give
    return tokens, labels


def _heads_at_layouts(hf_dirs: dict[str, str]) -> dict:
    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import ParallelConfig, build_model_chunks
    from megatron_prune.model.selective_gpt import TokenSelection
    from megatron_prune.training.parallel import model_parallel

    out = {}
    for kind, hf_dir in hf_dirs.items():
        arch = hf_convert.read_hf_arch(hf_dir)
        with hf_convert.HFCheckpoint(hf_dir) as lazy:
            hf = dict(lazy.items())
        tokens, labels = _tokens_and_labels(arch.vocab_size)
        rows, positions = _selection_rows()
        index = positions * B + rows
        position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
        for layout, (tp, sp) in LAYOUTS.items():
            parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
            with model_parallel(parallel):
                [model] = build_model_chunks(arch, parallel)
                model.eval()
                hf_convert.fill_model_from_hf([model], hf=hf, arch=arch)
                for head in HEADS:
                    for name, temperature in _temperatures(len(index)).items():
                        selection = TokenSelection(index=index, labels=labels[rows, positions],
                                                   seq_ids=torch.zeros_like(index), temperature=temperature,
                                                   all_labels=labels if head == "baseline" else None)
                        with torch.no_grad():
                            out[kind, layout, head, name] = model(tokens, position_ids, None,
                                                                  token_selection=selection).float().cpu()
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf-head")
    return {kind: make_hf_model(kind, str(root / kind), seed=4 + i) for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def results(hf_dirs) -> dict:
    return run_distributed(_heads_at_layouts, 2, hf_dirs=hf_dirs)


@pytest.mark.parametrize("temperature", ["none", "scalar", "per-row"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_head_matches_transformers(hf_dirs, results, kind, layout, head, temperature):
    hf = load_hf_model(hf_dirs[kind])
    tokens, labels = _tokens_and_labels(hf.config.vocab_size)
    rows, positions = _selection_rows()
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits.double()[rows, positions]  # [n, V]
    t = _temperatures(len(rows))[temperature]
    if t is not None:
        logits = logits / (torch.as_tensor(t, dtype=torch.float64).reshape(-1, 1) if torch.is_tensor(t) else t)
    want = logits.log_softmax(-1).gather(1, labels[rows, positions].unsqueeze(1)).squeeze(1)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got[kind, layout, head, temperature].double(), want, atol=2e-5, rtol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
