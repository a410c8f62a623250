"""Mixture-of-experts pieces of the model: Megatron's MoE settings for a :class:`ModelArch`, the
per-layer mix of dense-MLP and MoE layer specs, and the router losses a training pass reports.

Routing is drop-less (every token reaches its top-k experts, no capacity factor), so a MoE model
computes the same function at every expert-parallel layout; the router runs in fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import unwrap_model

from megatron_prune.model.arch import ModelArch

ROUTER_LOSS_NAMES = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}
"""Megatron's tracker names of the router losses -> our metric names."""
TOKEN_DISPATCHERS = ("alltoall", "allgather")


def moe_config_kwargs(arch: ModelArch, parallel, *, grouped_gemm: bool) -> dict:
    """Megatron ``TransformerConfig`` keyword arguments of a MoE ``arch`` at ``parallel``
    (:class:`~megatron_prune.model.provider.ParallelConfig`); empty for a dense one."""
    ep = parallel.expert_model_parallel_size
    if ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if not arch.is_moe:
        if ep > 1:
            raise ValueError("--expert-model-parallel-size > 1 needs a mixture-of-experts model")
        return {}
    if arch.num_experts % ep:
        raise ValueError(f"num_experts ({arch.num_experts}) is not divisible by --expert-model-parallel-size ({ep})")
    if parallel.moe_token_dispatcher not in TOKEN_DISPATCHERS:
        raise ValueError(
            f"--moe-token-dispatcher must be one of {', '.join(TOKEN_DISPATCHERS)}, got {parallel.moe_token_dispatcher!r}"
        )
    if ep > 1 and parallel.moe_token_dispatcher == "allgather":
        # The ranks of an expert-parallel group hold different pairs or completions, so their
        # microbatches differ in shape, and Megatron's allgather dispatcher gathers equal shapes only.
        raise ValueError("--moe-token-dispatcher allgather needs --expert-model-parallel-size 1: the expert-parallel "
                         "ranks' microbatches differ in shape, which that dispatcher cannot gather; use alltoall")
    if parallel.tensor_model_parallel_size > 1 and not parallel.sequence_parallel:
        raise ValueError("a mixture-of-experts model at --tensor-model-parallel-size > 1 needs --sequence-parallel")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if not (getattr(parallel, name) >= 0 and math.isfinite(getattr(parallel, name))):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {getattr(parallel, name)}")
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_layer_freq=arch.moe_layer_pattern(),
        # softmax over all experts then top-k (HF norm_topk_prob=False) is Megatron's pre-softmax;
        # top-k then softmax over the chosen k equals the renormalised top-k (norm_topk_prob=True).
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(parallel.moe_aux_loss_coeff),
        moe_z_loss_coeff=float(parallel.moe_z_loss_coeff) or None,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type=parallel.moe_token_dispatcher,
        moe_grouped_gemm=grouped_gemm,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
    )


def layer_specs_with_moe(arch: ModelArch, config, dense_spec, *, vp_stage: int | None, n_local: int) -> list:
    """This stage's layer specs: ``dense_spec`` where the layer keeps a dense MLP, the same spec with
    Megatron's local MoE layer (sequential experts) where the layer is sparse."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    moe_mlp = get_gpt_layer_local_spec(
        num_experts=arch.num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    ).submodules.mlp
    moe_spec = dataclasses.replace(dense_spec, submodules=dataclasses.replace(dense_spec.submodules, mlp=moe_mlp))
    moe_spec = with_group_mean_z_loss(moe_spec)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = arch.moe_layer_pattern()
    return [moe_spec if pattern[offset + i] else dense_spec for i in range(n_local)]


def with_group_mean_z_loss(layer_spec):
    """``layer_spec`` with :class:`GroupMeanZLossRouter` as its MoE router; a dense layer's unchanged."""
    mlp = layer_spec.submodules.mlp
    if getattr(getattr(mlp, "submodules", None), "router", None) is None:
        return layer_spec
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, router=GroupMeanZLossRouter))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))


class GroupMeanZLossRouter(TopKRouter):
    """Megatron's top-k router whose z-loss with a padding mask is the mean over the valid tokens of
    the whole sequence-parallel group. Megatron averages over each rank's own valid tokens and then
    over the ranks, which weighs a shard holding little padding the same as one holding much: the
    loss would depend on the tensor-parallel size and on where the padding falls."""

    def apply_z_loss(self, logits, padding_mask=None):
        config = self.config
        group = self.tp_cp_group
        if (padding_mask is None or group.size() == 1 or config.moe_z_loss_coeff is None or not self.training
                or not torch.is_grad_enabled() or self.calculate_per_token_loss):
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        valid = (~padding_mask).to(torch.float32)
        count = valid.sum().detach()
        dist.all_reduce(count, group=group)
        # This rank's part of the group's mean; the sequence-parallel gradient all-reduce sums the parts.
        share = (torch.logsumexp(logits.float(), dim=-1).square() * valid).sum() / count.clamp(min=1.0)
        logits = MoEAuxLossAutoScaler.apply(logits, share * config.moe_z_loss_coeff)
        num_layers = config.num_layers + (config.mtp_num_layers or 0)
        # Megatron's tracker keeps a per-rank mean, averaged over the group when reported.
        save_to_aux_losses_tracker("z_loss", share.detach() * group.size(), self.layer_number, num_layers)
        return logits


@contextlib.contextmanager
def router_loss_scale(model_chunk, factor: float):
    """Inside: ``model_chunk``'s MoE routers add their load-balancing and z-losses times ``factor``
    (0: none, for a forward of rows that carry nothing to train: a placeholder microbatch keeps its
    zero loss and gradient). The routers read the coefficients from the shared config at each
    forward, so this holds for the forward only: a recompute of the router in the backward would
    read the restored ones (:func:`router_reruns_in_backward`)."""
    config = None if factor == 1.0 else unwrap_model(model_chunk).config
    if not getattr(config, "num_moe_experts", None):
        yield
        return
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    config.moe_aux_loss_coeff = saved[0] * factor
    config.moe_z_loss_coeff = saved[1] * factor if saved[1] and factor else None  # None: Megatron skips the z-loss
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved


def router_reruns_in_backward(recompute_kwargs: dict) -> bool:
    """Whether Megatron's recompute (``TransformerConfig`` fields) runs the MoE routers again in the
    backward, where they add their losses with the coefficients the config holds at that time."""
    granularity = recompute_kwargs.get("recompute_granularity")
    return granularity == "full" or (granularity == "selective" and "moe" in recompute_kwargs.get("recompute_modules", ()))


def clear_router_losses() -> None:
    """Forget router losses tracked so far (Megatron accumulates them over microbatches)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def pop_router_losses(model, *, num_microbatches: int) -> dict[str, float]:
    """The router losses the last training pass of ``model`` (its chunks) added to its loss, and
    clear Megatron's tracker.

    Per loss: the sum over MoE layers of coefficient x loss, this rank's mean over its
    ``num_microbatches`` microbatches, then the mean over data-parallel ranks: what the pass added
    to the loss, as Megatron weights each rank's router losses (1 / (its microbatches x DP size)).
    Collective over the pipeline, tensor and data-parallel groups; every rank gets the same
    numbers. Empty for a dense model or when both coefficients are 0.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    config = unwrap_model(model[0]).config
    coeffs = {"moe_aux_loss": config.moe_aux_loss_coeff or 0.0, "moe_z_loss": config.moe_z_loss_coeff or 0.0}
    if not config.num_moe_experts or not any(coeffs.values()):
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    out: dict[str, float] = {}
    for name, metric in ROUTER_LOSS_NAMES.items():
        if not coeffs[metric]:
            continue
        entry = tracker.get(name)
        total = torch.zeros(1, dtype=torch.float64)
        if entry is not None:
            total += entry["values"].detach().double().sum().cpu()
            # The tensor-parallel ranks of one stage share its layers, so all or none of them reduce.
            if dist.is_initialized():
                if entry.get("reduce_group") is not None:
                    dist.all_reduce(total, group=entry["reduce_group"])
                else:  # a per-rank mean over the rank's own tokens (z-loss): averaged over the group
                    tp_group = parallel_state.get_tensor_model_parallel_group()
                    dist.all_reduce(total, group=tp_group)
                    total /= tp_group.size()
        if dist.is_initialized():
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        total /= max(num_microbatches, 1)  # ranks may run different numbers of microbatches
        if dist.is_initialized():
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            total /= parallel_state.get_data_parallel_world_size()
        out[metric] = coeffs[metric] * float(total)
    clear_router_losses()
    return out


def add_router_losses(outputs: list[dict], model, *, num_microbatches: int) -> dict[str, float]:
    """Pop the router losses of the training pass that produced ``outputs`` and add them to each
    microbatch's metrics (as ``[value, 1]``, so averaging over microbatches keeps the value).
    A no-op for a dense model; collective like :func:`pop_router_losses`."""
    losses = pop_router_losses(model, num_microbatches=num_microbatches)
    for out in outputs:
        for name, value in losses.items():
            out[name] = torch.tensor([value, 1.0], dtype=torch.float64)
    return losses
