"""Next-token language-model forward step: the objective of the model-parity tests (no trainer uses it)."""

from __future__ import annotations

from functools import partial
from typing import Iterator

import torch


def lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean next-token cross entropy over the unmasked positions of one microbatch."""
    mask = loss_mask.to(device=output_tensor.device, dtype=torch.float32)
    count = mask.sum().clamp(min=1.0)
    loss = (output_tensor.float() * mask).sum() / count
    return loss, {"lm_loss": torch.stack([loss.detach() * count, count])}


def lm_forward_step(data_iterator: Iterator, model):
    """Megatron forward step: batch dict with tokens, labels, loss_mask ([b, s] each)."""
    batch = next(data_iterator)
    tokens = batch["tokens"]
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    output = model(tokens, position_ids, None, labels=batch["labels"])
    return output, partial(lm_loss_func, batch["loss_mask"])
