"""An independent DPO objective in plain PyTorch, for checking what the trainer computes.

It shares nothing with ``megatron_prune.dpo`` but the Megatron model and the tokenised pairs:
every response is its own unpadded row ``prompt + response`` (plain causal attention, positions
0..n-1), the model returns full-vocabulary logits (no token selection), and the log-probs,
the per-response reduction and the logistic loss are written out here:

    Δ_r = reduce_t (log π(y_t | y_<t) − log π_ref(y_t | y_<t)),   reduce = mean or sum over the response
    loss = mean over pairs of −log σ(β (Δ_chosen − Δ_rejected))

Gradients are taken with ``torch.autograd.grad`` on the model's own parameters (not through
Megatron's gradient buffers). Single rank only (TP = PP = 1): the logits are whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The Megatron GPT model inside a DDP wrapper (or the model itself)."""
    return chunk.module if hasattr(chunk, "module") else chunk


def response_logps(model: torch.nn.Module, prompt: list[int], response: list[int], *, vocab_size: int) -> torch.Tensor:
    """log π(response_t | prompt, response_<t) for every response token ([len(response)])."""
    seq = list(prompt) + list(response)
    tokens = torch.tensor([seq], dtype=torch.long)
    positions = torch.arange(len(seq), dtype=torch.long)[None]
    logits = unwrap(model)(tokens, positions, None)  # [1, s, padded vocab]: no labels, no selection
    assert logits.dim() == 3 and logits.shape[:2] == (1, len(seq)), tuple(logits.shape)
    # Rows beyond the tokenizer's vocabulary are Megatron's padding, not tokens.
    logp = torch.log_softmax(logits[0, :, :vocab_size].float(), dim=-1)
    start = len(prompt) - 1  # position t predicts token t + 1
    predicted = logp[start : start + len(response)]
    return predicted.gather(1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0]


def log_ratio(policy, reference, prompt, response, *, vocab_size: int, reduction: str) -> torch.Tensor:
    """Δ of one response: the reduced policy/reference log-ratio (grad flows through the policy)."""
    pol = response_logps(policy, prompt, response, vocab_size=vocab_size)
    with torch.no_grad():
        ref = response_logps(reference, prompt, response, vocab_size=vocab_size)
    diff = pol - ref
    if reduction == "mean":
        return diff.sum() / len(response)
    if reduction == "sum":
        return diff.sum()
    raise ValueError(reduction)


def pair_log_ratios(policy, reference, pairs, *, vocab_size: int, reduction: str):
    """(Δ_chosen, Δ_rejected), each [num_pairs], for ``PreferencePair``-like objects."""
    chosen = [log_ratio(policy, reference, p.prompt_ids, p.chosen_ids, vocab_size=vocab_size, reduction=reduction)
              for p in pairs]
    rejected = [log_ratio(policy, reference, p.prompt_ids, p.rejected_ids, vocab_size=vocab_size,
                          reduction=reduction) for p in pairs]
    return torch.stack(chosen), torch.stack(rejected)


def dpo_loss(policy, reference, pairs, *, beta: float, vocab_size: int, reduction: str) -> dict:
    """Loss (mean over pairs), margins β(Δ_w − Δ_l) and the log-ratios of ``pairs``."""
    chosen, rejected = pair_log_ratios(policy, reference, pairs, vocab_size=vocab_size, reduction=reduction)
    margins = beta * (chosen - rejected)
    return dict(loss=-F.logsigmoid(margins).mean(), margins=margins, chosen=chosen, rejected=rejected)


def loss_and_grads(policy_chunk, reference_chunk, pairs, *, beta: float, vocab_size: int, reduction: str) -> dict:
    """Loss and ``{parameter name: gradient}`` of the reference objective (no Megatron buffers touched)."""
    model = unwrap(policy_chunk)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = dpo_loss(policy_chunk, reference_chunk, pairs, beta=beta, vocab_size=vocab_size, reduction=reduction)
    grads = torch.autograd.grad(out["loss"], [p for _, p in named], allow_unused=True)
    return dict(
        loss=float(out["loss"]),
        margins=out["margins"].detach(),
        chosen=out["chosen"].detach(),
        rejected=out["rejected"].detach(),
        grads={n: (torch.zeros_like(p) if g is None else g.detach().clone()) for (n, p), g in zip(named, grads)},
    )


def reward_accuracy(margins: torch.Tensor) -> float:
    """Fraction of pairs ranked right; a tie counts half."""
    return float(((margins > 0).double() + 0.5 * (margins == 0).double()).mean())


def main_grads(policy_chunk) -> dict[str, torch.Tensor]:
    """``{parameter name: accumulated gradient}`` from Megatron's DDP gradient buffer (single rank)."""
    model = unwrap(policy_chunk)
    return {n: p.main_grad.detach().float().clone().view_as(p) for n, p in model.named_parameters() if p.requires_grad}


def assert_grads_close(expected: dict, got: dict, label: str, *, rtol: float = 1e-4) -> None:
    """Every gradient equal within fp32 noise, relative to each tensor's own largest entry."""
    assert set(expected) == set(got), f"{label}: parameters differ: {set(expected) ^ set(got)}"
    for name, want in expected.items():
        atol = max(1e-8, rtol * float(want.abs().max()))
        torch.testing.assert_close(got[name], want.float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{label}: grad {name}: {m}")
