"""Build a Megatron ``GPTModel`` (our selective-head subclass) from a :class:`ModelArch`."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_prune.accelerator import get_accelerator
from megatron_prune.config import FULL_RECOMPUTE
from megatron_prune.model.arch import ModelArch
from megatron_prune.model.decode_attention import with_rotated_key_cache
from megatron_prune.model.hf_mapping import VOCAB_PAD_MULTIPLE, padded_vocab_size  # noqa: F401 - re-exported
from megatron_prune.model.norm import RMSNorm
from megatron_prune.model.swiglu import SwiGLU
from megatron_prune.model.segment_attention import with_segment_attention


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout and numerics of the model being built."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (PP)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); None for the plain 1F1B schedule."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in TP regions (needs TP > 1)."""
    bf16: bool = False
    """Parameters and activations in bfloat16 (fp32 main weights in the optimizer)."""
    recompute: bool = False
    """Full activation recomputation of every layer in backward."""
    recompute_options: dict = field(default_factory=dict)
    """Megatron's recompute fields of TransformerConfig (granularity, method, layers, modules), as the
    ``--recompute-*`` flags give them; ``recompute`` is the same as full, uniform, 1 layer."""
    transformer_engine: bool | None = None
    """Use the Transformer-Engine layer spec; None = when TE imports and the accelerator is a GPU."""
    expert_model_parallel_size: int = 1
    """Expert-parallel ranks (EP) of a MoE model: each holds num_experts / EP experts of every MoE layer."""
    moe_token_dispatcher: str = "alltoall"
    """How tokens reach the experts' ranks: alltoall or allgather (Megatron's token dispatchers)."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the router's load-balancing loss, added in training passes only (0 = off)."""
    moe_z_loss_coeff: float = 0.0
    """Coefficient of the router's z-loss, added in training passes only (0 = off)."""
    perform_initialization: bool = True
    """Run Megatron's weight initialisation. False leaves the parameters unset (and skips the full-size
    fp32 copy Megatron's CPU initialisation makes): only for a model whose every weight is then
    overwritten, as the HF importer does."""


def use_transformer_engine(parallel: ParallelConfig) -> bool:
    if parallel.transformer_engine is not None:
        return parallel.transformer_engine
    return get_accelerator().kind == "cuda" and importlib.util.find_spec("transformer_engine") is not None


def transformer_config(arch: ModelArch, parallel: ParallelConfig) -> TransformerConfig:
    """The Megatron ``TransformerConfig`` for ``arch`` at ``parallel``."""
    dtype = torch.bfloat16 if parallel.bf16 else torch.float32
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=parallel.bf16,
        # Weights are then overwritten by megatron_prune.model.init (layout independent) or a
        # checkpoint, but Megatron only marks TP-split weights (tensor_model_parallel, used by the
        # grad-norm and checkpoint code) inside its init routines, so they run unless the caller
        # overwrites every weight and only saves it (the HF importer; the checkpoint's shard map
        # comes from the modules, not from those marks).
        perform_initialization=parallel.perform_initialization,
        use_cpu_initialization=get_accelerator().kind == "cpu",
        deallocate_pipeline_outputs=True,
        init_method_std=0.02,
    )
    from megatron_prune.model.moe import moe_config_kwargs

    kwargs.update(moe_config_kwargs(arch, parallel, grouped_gemm=use_transformer_engine(parallel)))
    if parallel.recompute:
        kwargs.update(FULL_RECOMPUTE)
    kwargs.update(parallel.recompute_options)
    if parallel.virtual_pipeline_model_parallel_size and get_accelerator().kind == "cpu":
        # Measured on gloo: the interleaved schedule with batched isend/irecv gives wrong gradients.
        kwargs["batch_p2p_comm"] = False
    # A dense model on the local spec takes its SwiGLU from the spec (megatron_prune.model.swiglu:
    # keeps only fc1's output for the backward); Megatron's MLP reads the spec's activation only
    # under this flag. MoE experts and the TE spec keep Megatron's own activation.
    kwargs["use_te_activation_func"] = not use_transformer_engine(parallel) and not arch.is_moe
    return TransformerConfig(**kwargs)


def _local_block_spec(arch: ModelArch, config: TransformerConfig, vp_stage: int | None) -> TransformerBlockSubmodules:
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    sub = layer_spec.submodules
    norm = ModuleSpec(module=RMSNorm)
    sub = dataclasses.replace(sub, input_layernorm=norm, pre_mlp_layernorm=norm)
    attn = layer_spec.submodules.self_attention
    if arch.qk_norm:
        attn = dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, q_layernorm=norm, k_layernorm=norm)
        )
    sub = dataclasses.replace(sub, self_attention=attn)
    if config.use_te_activation_func:
        assert not arch.is_moe, "a MoE layer's experts would apply the flag without this spec"
        mlp = sub.mlp
        sub = dataclasses.replace(sub, mlp=dataclasses.replace(
            mlp, submodules=dataclasses.replace(mlp.submodules, activation_func=ModuleSpec(module=SwiGLU))))
    layer_spec = with_rotated_key_cache(with_segment_attention(dataclasses.replace(layer_spec, submodules=sub)))
    n_local = get_num_layers_to_build(config, vp_stage=vp_stage)
    layer_specs = [layer_spec] * n_local
    if arch.is_moe:
        from megatron_prune.model.moe import layer_specs_with_moe

        layer_specs = layer_specs_with_moe(arch, config, layer_spec, vp_stage=vp_stage, n_local=n_local)
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=norm)


def _te_block_spec(arch: ModelArch, config: TransformerConfig, vp_stage: int | None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_prune.model.moe import with_group_mean_z_loss

    # The QK norm comes from config.qk_layernorm (the builder takes no such argument).
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage)
    # Transformer-Engine's core attention gains the segment path (flash varlen); untested without a GPU.
    return dataclasses.replace(spec, layer_specs=[
        with_group_mean_z_loss(with_rotated_key_cache(with_segment_attention(layer))) for layer in spec.layer_specs])


def build_model_chunks(arch: ModelArch, parallel: ParallelConfig) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual stage) on the accelerator, unwrapped.

    Parallel state must already be initialised (:mod:`megatron_prune.training.parallel`).
    """
    from megatron_prune.model.selective_gpt import SelectiveGPTModel

    config = transformer_config(arch, parallel)
    te = use_transformer_engine(parallel)
    vpp = parallel.virtual_pipeline_model_parallel_size
    scaling = arch.rope_scaling or {}
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        spec = _te_block_spec(arch, config, stage) if te else _local_block_spec(arch, config, stage)
        model = SelectiveGPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(arch.vocab_size),
            true_vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            rope_scaling=scaling.get("rope_type", scaling.get("type")) == "llama3",  # {"rope_type": "default"}: none
            rope_scaling_factor=float(scaling.get("factor", 8.0)),
            vp_stage=stage,
        )
        model.to(get_accelerator().device)
        chunks.append(model)
    return chunks
