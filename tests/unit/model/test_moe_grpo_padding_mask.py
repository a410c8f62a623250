"""The router padding mask of a GRPO microbatch marks exactly its padding: a mixture-of-experts
router's load-balancing and z-losses count every real token (each prompt's first included) and no
padding, whatever the layout (padded rows, dense packing, shared prompts, placeholder rows)."""

from __future__ import annotations

import random

import pytest

from megatron_prune.grpo.loss import GRPOLossConfig
from megatron_prune.grpo.step import GRPOStepSettings, TrainItem, layout_items

PAD = 0


def _items(n: int, seed: int = 0) -> list[TrainItem]:
    """Groups of 3 completions per prompt; no real token is the padding id."""
    rng = random.Random(seed)
    prompts = [[rng.randint(1, 50) for _ in range(rng.randint(2, 12))] for _ in range((n + 2) // 3)]
    return [TrainItem(prompt_id=k // 3, index=k % 3, prompt=list(prompts[k // 3]),
                      completion=[rng.randint(1, 50) for _ in range(rng.randint(1, 9))], advantage=1.0)
            for k in range(n)]


@pytest.mark.parametrize("layout", ["padded", "packed", "shared-prompt", "shared-prompt-packed", "padded-pp2"])
def test_router_padding_mask_is_exactly_the_padding(layout):
    items = _items(8)
    settings = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=3, pad_id=PAD,
                                dense_packing=layout.endswith("packed"), pack_capacity=48,
                                shared_prompt=layout.startswith("shared"))
    got = layout_items(items, settings=settings, pp=2 if layout.endswith("pp2") else 1)
    if settings.shared_prompt:  # one prompt copy per group of completions
        groups = {it.prompt_id: it.prompt for it in items}
        real = sum(map(len, groups.values())) + sum(len(it.completion) for it in items)
    else:
        real = sum(len(it.prompt) + len(it.completion) for it in items)
    counted = 0
    for batch in got.batches:
        assert batch.padding_mask is not None and batch.padding_mask.shape == batch.tokens.shape
        assert batch.padding_mask.equal(batch.tokens == PAD)
        counted += int((~batch.padding_mask).sum())
    assert counted == real == got.valid_tokens
    assert any(batch.padding_mask.any() for batch in got.batches)  # there was padding to mask
