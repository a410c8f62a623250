"""LoRA adapters on Megatron's tensor-parallel linears, and the adapter-off reference.

A targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` of a built model is turned in place
into its LoRA subclass (:func:`apply_lora`): the base weight keeps its name, shard and
checkpoint key, two adapter parameters ``lora_A`` [r, in] and ``lora_B`` [out, r] are added, and
the output becomes ``base(x) + (alpha / r) * B A dropout(x)``. Megatron itself is not patched.

Tensor parallelism follows the base layer:

- column-parallel base (``linear_qkv``, ``linear_fc1``): ``A`` is replicated, ``B`` is split
  along its rows like the base's output rows (so the interleaved QKV and gated fc1 layouts need
  nothing special in training: B's row ``i`` feeds the base's output row ``i``; in the checkpoint
  a gated fc1's ``B`` is mapped to the global [gate; up] rows like its weight). The rank-r activation
  ``x A^T`` is formed on the local input and then, under sequence parallelism, all-gathered along
  the sequence (the small [s/tp, b, r] tensor, not the [s/tp, b, h] input the base gathers);
  its backward sums the partial gradients of the TP ranks, so ``A``'s gradient is complete;
- row-parallel base (``linear_proj``, ``linear_fc2``): ``A`` is split along its columns like
  the base's input, the partial rank-r products are summed over TP (all-reduce, or
  reduce-scatter along the sequence under sequence parallelism) before the replicated ``B``.

Under sequence parallelism the replicated adapter weight whose gradient is a partial sum over
sequence shards (``A`` of a column base, ``B`` of a row base) carries Megatron's
``sequence_parallel`` mark, so ``finalize_model_grads`` all-reduces it over TP like a norm weight.

Experts of a MoE layer (Megatron's local ``SequentialMLP``: each expert's ``linear_fc1`` /
``linear_fc2`` gets its own adapter; the router none) run with ``explicit_expert_comm``: the token
dispatcher moves tokens over the expert TP group, so the adapter path adds no communication. A
column expert forms ``x A^T`` on the tokens the dispatcher gathered; a row expert's ``B`` products
stay partial over expert TP like the base's output and are summed when the dispatcher combines.
Either way the replicated weight's gradient is partial over expert TP and carries the same mark.
Adapters carry their base weight's ``allreduce`` attribute, so at EP > 1 expert adapters sit in
DDP's expert buffers (reduced over the expert-data-parallel group) and in the expert optimizer;
their checkpoint keys carry the global expert index, like the expert weights'.

``B`` starts at zero, so a fresh adapter is exactly the base model. Adapters are initialised
layout-independently: each whole tensor comes from a generator keyed by (seed, checkpoint key,
layer) and every rank copies its own slice, as :mod:`megatron_prune.model.init` does for the
base. Only adapters train: :func:`apply_lora` freezes every other parameter before Megatron's
DDP wraps the model, so base weights get no gradient buffer and no optimizer state.

:func:`adapter_off` returns views of the policy chunks that run with every adapter switched
off: the reference model of DPO and of GRPO's KL term without a second copy of the weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_data_parallel_rng_tracker_name
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import unwrap_model

from megatron_prune.lora_config import TARGETS, LoRAConfig  # noqa: F401 (re-exported)


_dropout_pass: bool | None = None
"""Whether the model forward now running draws adapter dropout; None outside a model forward."""

_dropout_as_training: bool | None = None
"""Set inside :func:`adapter_dropout_as`: whether the forwards inside draw dropout, whatever their grad mode."""


@contextlib.contextmanager
def adapter_dropout_pass() -> Iterator[None]:
    """Around one model forward: adapter dropout runs in it where gradients are on as it starts
    (or as :func:`adapter_dropout_as` says, inside one).

    Decided once per forward, not per layer, because Megatron's full recompute runs each layer's
    first forward under ``no_grad`` inside a training pass and recomputes it with gradients in
    backward (restoring the RNG state): judged per layer, the loss would come from a model without
    dropout and the gradients from one with it. Outside any forward (that recompute) the layer's
    own grad mode decides.
    """
    global _dropout_pass
    decided = torch.is_grad_enabled() if _dropout_as_training is None else _dropout_as_training
    outer, _dropout_pass = _dropout_pass, decided
    try:
        yield
    finally:
        _dropout_pass = outer


@contextlib.contextmanager
def adapter_dropout_as(training: bool) -> Iterator[None]:
    """Model forwards inside draw adapter dropout if ``training``, with or without gradients.

    For forward-only passes whose values stand in for the training pass's own: DPO branch
    pruning's pruned responses. The full step scores both responses of a pair under dropout;
    scored without it, the pruned one would enter the loss from another model than the kept one.
    """
    global _dropout_as_training
    outer, _dropout_as_training = _dropout_as_training, training
    try:
        yield
    finally:
        _dropout_as_training = outer


class _LoRAMixin:
    """Adapter state and arithmetic shared by the column- and row-parallel LoRA linears."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_enabled: bool

    def _add_adapter(self, *, rank: int, in_local: int, out_local: int, scale: float, dropout: float) -> None:
        w = self.weight
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=w.dtype, device=w.device))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=w.dtype, device=w.device))
        self.lora_scale = scale
        self.lora_dropout = dropout
        self.lora_enabled = True

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        training_pass = torch.is_grad_enabled() if _dropout_pass is None else _dropout_pass
        if self.lora_dropout and self.training and training_pass:
            tracker = get_cuda_rng_tracker()
            stream = tracker.fork() if self._input_split_over_tp() else tracker.fork(get_data_parallel_rng_tracker_name())
            with stream:
                x = F.dropout(x, p=self.lora_dropout, training=True)
        return x

    def _input_split_over_tp(self) -> bool:
        """Whether the TP ranks hold different parts of this adapter's input (a row base's input
        columns, sequence shards) rather than the same input (a column base's replicated input, an
        expert's gathered tokens). Its dropout mask comes from each TP rank's own RNG stream in the
        first case and from one they share in the second."""
        return isinstance(self, RowParallelLinear) or (self.sequence_parallel and not self.explicit_expert_comm)

    def _plus_up_projection(self, output: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """``output + scale * low B^T`` as one ``addmm``: no ``[tokens, out]`` temporaries for the
        product and its scaled copy, in forward or backward. With ``B = 0`` the result is ``output``
        exactly. ``low``, ``B`` and ``output`` share the base weight's dtype (the adapters are made in it)."""
        flat = torch.addmm(output.reshape(-1, output.shape[-1]), low.reshape(-1, low.shape[-1]), self.lora_B.t(),
                           alpha=self.lora_scale)
        return flat.view(output.shape)


class LoRAColumnParallelLinear(_LoRAMixin, ColumnParallelLinear):
    """ColumnParallelLinear + LoRA: ``A`` replicated, ``B`` split like the output rows."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if not self.lora_enabled:
            return output, bias
        low = F.linear(self._adapter_input(input_), self.lora_A)  # [s(/tp), b, r], partial in no rank
        if self.explicit_expert_comm:
            pass  # an expert: its tokens are already gathered over the expert TP group, like the base's input
        elif self.sequence_parallel:
            low = gather_from_sequence_parallel_region(low, tensor_parallel_output_grad=True, group=self.tp_group)
        else:
            low = copy_to_tensor_model_parallel_region(low, group=self.tp_group)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if not gather:
            return self._plus_up_projection(output, low), bias  # [s, b, out/tp]
        delta = gather_from_tensor_model_parallel_region(F.linear(low, self.lora_B) * self.lora_scale,
                                                         group=self.tp_group)
        return output + delta.to(output.dtype), bias

    lora_swiglu: bool = False
    """True on a gated fc1, whose local rows are [gate shard; up shard] of the global [gate; up]."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            state_dict, prefix, {"weight": 0, "bias": 0, "lora_B": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        if self.lora_swiglu:
            # The MLP re-maps its fc1 weight this way; B's rows follow the same layout.
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B"
            sharded[key] = apply_swiglu_sharded_factory(
                sharded[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
            )
        return sharded


class LoRARowParallelLinear(_LoRAMixin, RowParallelLinear):
    """RowParallelLinear + LoRA: ``A`` split like the input, partial sums reduced before ``B``."""

    def forward(self, input_):
        output, bias = super().forward(input_)
        if not self.lora_enabled:
            return output, bias
        partial = F.linear(self._adapter_input(input_), self.lora_A)  # [s, b, r], partial over TP
        if self.explicit_expert_comm:
            # An expert: like the base's output, B's partial products are summed when the token
            # dispatcher combines the expert TP ranks' outputs.
            return self._plus_up_projection(output, partial), bias
        if self.sequence_parallel:
            low = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            low = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        return self._plus_up_projection(output, low), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state_dict, prefix, {"weight": 1, "lora_A": 1}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


LORA_LINEARS = (LoRAColumnParallelLinear, LoRARowParallelLinear)


def lora_modules(chunks) -> list[_LoRAMixin]:
    """Every LoRA linear of ``chunks`` (DDP-wrapped or not)."""
    return [m for c in chunks for m in unwrap_model(c).modules() if isinstance(m, LORA_LINEARS)]


def is_lora_model(chunks) -> bool:
    return bool(lora_modules(chunks))


def _convert(module: torch.nn.Module, *, name: str, config: LoRAConfig) -> None:
    if type(module) is ColumnParallelLinear:
        module.__class__ = LoRAColumnParallelLinear
        module._add_adapter(rank=config.rank, in_local=module.input_size, out_local=module.output_size_per_partition,
                            scale=config.scale, dropout=config.dropout)
        module.lora_swiglu = name.rsplit(".", 1)[-1] == "linear_fc1" and module.config.gated_linear_unit
        set_tensor_model_parallel_attributes(module.lora_B, is_parallel=True, dim=0, stride=1)
        _mark_replicated_partial_grad(module, module.lora_A, name=name)
    elif type(module) is RowParallelLinear:
        if not module.input_is_parallel:
            raise ValueError(f"LoRA on {name}: a row-parallel linear whose input is not split is not supported")
        module.__class__ = LoRARowParallelLinear
        module._add_adapter(rank=config.rank, in_local=module.input_size_per_partition, out_local=module.output_size,
                            scale=config.scale, dropout=config.dropout)
        set_tensor_model_parallel_attributes(module.lora_A, is_parallel=True, dim=1, stride=1)
        _mark_replicated_partial_grad(module, module.lora_B, name=name)
    else:
        raise ValueError(
            f"LoRA on {name}: {type(module).__name__} is not Megatron's local ColumnParallelLinear/"
            "RowParallelLinear; LoRA models are built with the local layer spec"
        )
    # Expert weights at EP > 1 are reduced over the expert-data-parallel group (Megatron's DDP
    # keeps params with allreduce=False in its expert buffers); the adapters follow their base.
    for p in (module.lora_A, module.lora_B):
        p.allreduce = getattr(module.weight, "allreduce", True)


def _mark_replicated_partial_grad(module, param: torch.nn.Parameter, *, name: str) -> None:
    """Mark the TP-replicated adapter weight whose gradient is a partial sum over TP ranks, so
    ``finalize_model_grads`` sums it over TP (Megatron's ``sequence_parallel`` mark).

    Dense linears: only under sequence parallelism (each rank saw its sequence shard). Experts
    (``explicit_expert_comm``): whenever the expert TP group has several ranks, as each holds only
    its share of the products that meet this weight. Megatron then requires sequence parallelism,
    and the expert TP group must be the dense TP group the finalize step reduces over.
    """
    if not module.explicit_expert_comm:
        if module.sequence_parallel:
            param.sequence_parallel = True
        return
    if module.tp_group.size() <= 1:
        return
    from megatron.core import parallel_state

    dense = parallel_state.get_tensor_model_parallel_group()
    if dist.get_process_group_ranks(module.tp_group) != dist.get_process_group_ranks(dense):
        raise ValueError(f"LoRA on {name}: the expert tensor-parallel group differs from the tensor-parallel "
                         "group; LoRA on experts needs expert TP = TP")
    assert module.config.sequence_parallel, "a MoE model at TP > 1 runs with sequence parallelism"
    param.sequence_parallel = True


def _seed_for(seed: int, key: str, prefix: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"lora|{seed}|{key}|{prefix}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_adapters(chunks, *, seed: int) -> None:
    """``B = 0``; ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` generated whole and sliced like the base."""
    from megatron_prune.model.init import global_slice, iter_sharded_tensors

    for chunk in chunks:
        for sh in iter_sharded_tensors(unwrap_model(chunk).sharded_state_dict()):
            if sh.data is None or not sh.key.endswith((".lora_A", ".lora_B")):
                continue
            p = sh.prepend_axis_num
            shape = tuple(sh.global_shape[p:])
            if sh.key.endswith(".lora_B"):
                sh.data.zero_()
                continue
            gen = torch.Generator().manual_seed(_seed_for(seed, sh.key, tuple(sh.global_offset[:p])))
            bound = 1.0 / math.sqrt(shape[1])
            full = torch.rand(shape, generator=gen) * (2 * bound) - bound
            sh.data.copy_(global_slice(sh, full).to(sh.data.dtype))


def _first_stage_input_requires_grad(module, args, output):
    # Under full recomputation Megatron's checkpoint function only builds a graph when an input
    # requires grad; with a frozen embedding nothing does, and the adapters would get no gradient.
    if isinstance(output, torch.Tensor) and not output.requires_grad and torch.is_grad_enabled():
        output.requires_grad_(True)
    return output


def _grouped_experts() -> tuple[type, ...]:
    from megatron.core.transformer.moe.experts import GroupedMLP, TEGroupedMLP

    return (GroupedMLP, TEGroupedMLP)


def apply_lora(chunks: list[torch.nn.Module], config: LoRAConfig, *, seed: int) -> int:
    """Add adapters to the targeted linears of unwrapped ``chunks``, freeze everything else and
    initialise the adapters. Must run before Megatron's DDP wraps the chunks. Returns the number
    of adapted linears on this rank."""
    if not config.enabled:
        return 0
    targets = set(config.target_names)
    count = 0
    for chunk in chunks:
        assert not hasattr(chunk, "module"), "apply_lora runs on unwrapped chunks, before DDP"
        chunk.requires_grad_(False)
        for name, module in list(chunk.named_modules()):
            if isinstance(module, _grouped_experts()):
                raise ValueError(f"LoRA on {name}: grouped-GEMM experts ({type(module).__name__}) are not supported; "
                                 "LoRA models are built with the local layer spec (sequential experts)")
            if name.rsplit(".", 1)[-1] in targets:
                _convert(module, name=name, config=config)
                count += 1
        cfg = getattr(chunk, "config", None)
        if getattr(cfg, "recompute_granularity", None) is not None and getattr(chunk, "embedding", None) is not None:
            chunk.embedding.register_forward_hook(_first_stage_input_requires_grad)
    init_adapters(chunks, seed=seed)
    return count


@contextlib.contextmanager
def adapters_disabled(chunks, *, modules: list | None = None) -> Iterator[None]:
    """Run the base model: every adapter of ``chunks`` is off inside the block."""
    modules = lora_modules(chunks) if modules is None else modules
    previous = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, was in zip(modules, previous):
            m.lora_enabled = was


class AdapterOffView(torch.nn.Module):
    """A model chunk seen with its adapters off: forwards run the frozen base weights.

    It owns no parameters (the chunk is not registered as a submodule); Megatron's schedules
    reach the chunk's ``config`` and ``set_input_tensor`` through ``.module``.
    """

    def __init__(self, chunk: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "module", chunk)
        object.__setattr__(self, "_adapters", lora_modules([chunk]))

    def forward(self, *args, **kwargs):
        with adapters_disabled([], modules=self._adapters):
            return self.module(*args, **kwargs)


def adapter_off(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Views of the policy ``chunks`` that run with adapters disabled (the reference model)."""
    if not is_lora_model(chunks):
        raise ValueError("the adapter-off reference needs a LoRA model (--lora-rank > 0)")
    return [AdapterOffView(c) for c in chunks]
