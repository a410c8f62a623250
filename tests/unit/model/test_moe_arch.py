"""Qwen3-MoE architecture: read from a transformers config, per-layer MoE pattern, refusals."""

from __future__ import annotations

import pytest

from megatron_prune.model.arch import ModelArch, get_preset
from megatron_prune.model.moe import moe_config_kwargs
from megatron_prune.model.provider import ParallelConfig


def _qwen3_moe_config(**overrides) -> dict:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3],
    ).to_dict()
    cfg.update(overrides)
    return cfg


def test_from_transformers_qwen3_moe_config():
    arch = ModelArch.from_hf_config(_qwen3_moe_config())
    assert arch.model_type == "qwen3_moe" and arch.is_moe and arch.qk_norm
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    assert arch.intermediate_size == 96 and arch.norm_topk_prob
    # transformers: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert arch.moe_layer_pattern() == [0, 1, 0, 0, 0, 1]
    assert ModelArch.from_dict(arch.to_dict()) == arch


def test_layer_pattern_matches_transformers_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = _qwen3_moe_config(decoder_sparse_step=1, mlp_only_layers=[0, 4])
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    sparse = [int(hasattr(layer.mlp, "experts")) for layer in model.model.layers]
    assert ModelArch.from_hf_config(cfg).moe_layer_pattern() == sparse == [0, 1, 1, 1, 0, 1]


def test_transformers_4_expert_count_key_is_read():
    """transformers 5 writes the expert count as num_local_experts, transformers 4 (and the config.json
    of released Qwen3-MoE checkpoints) as num_experts: either key alone is read."""
    tf5 = _qwen3_moe_config()
    assert tf5.get("num_local_experts") == 8 and "num_experts" not in tf5
    tf4 = dict(tf5)
    tf4["num_experts"] = tf4.pop("num_local_experts")
    assert ModelArch.from_hf_config(tf4) == ModelArch.from_hf_config(tf5)
    assert ModelArch.from_hf_config(tf4).num_experts == 8


def test_missing_norm_topk_prob_is_read_as_transformers_reads_it():
    """A config.json without norm_topk_prob: transformers builds the model without renormalising the
    top-k weights, and so must the arch read from it."""
    from transformers import Qwen3MoeConfig

    config = _qwen3_moe_config()
    del config["norm_topk_prob"]
    hf = Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert ModelArch.from_hf_config(config).norm_topk_prob is hf.norm_topk_prob is False


@pytest.mark.parametrize("norm_topk_prob, pre_softmax", [(True, False), (False, True)])
def test_router_weights_follow_norm_topk_prob(norm_topk_prob, pre_softmax):
    """HF without renormalisation weights the chosen experts by their softmax over all experts
    (Megatron's pre-softmax router); with it, by the softmax over the chosen k (Megatron's default)."""
    arch = ModelArch.from_hf_config(_qwen3_moe_config(norm_topk_prob=norm_topk_prob))
    assert arch.norm_topk_prob is norm_topk_prob
    kw = moe_config_kwargs(arch, ParallelConfig(), grouped_gemm=False)
    assert kw["moe_router_pre_softmax"] is pre_softmax and kw["moe_router_score_function"] == "softmax"


def test_dense_models_are_unchanged():
    tiny = get_preset("tiny")
    assert not tiny.is_moe and tiny.moe_layer_pattern() == [0] * tiny.num_layers
    assert moe_config_kwargs(tiny, ParallelConfig(), grouped_gemm=False) == {}


def test_tiny_moe_preset():
    arch = get_preset("tiny-moe")
    assert arch.moe_layer_pattern() == [0, 1, 1, 1]
    kw = moe_config_kwargs(arch, ParallelConfig(expert_model_parallel_size=2), grouped_gemm=False)
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 32
    assert kw["moe_expert_capacity_factor"] is None and kw["moe_router_dtype"] == "fp32"
    assert kw["moe_router_pre_softmax"] is False and kw["moe_z_loss_coeff"] is None
    assert kw["expert_model_parallel_size"] == 2 and kw["moe_layer_freq"] == [0, 1, 1, 1]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(shared_expert_intermediate_size=128), "shared experts"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok must be in"),
        (dict(mlp_only_layers=[0, 1, 2, 3, 4, 5]), "leave no MoE layer"),
        (dict(mlp_only_layers=[7]), "outside"),
        (dict(moe_intermediate_size=None), "moe_intermediate_size"),
    ],
)
def test_unsupported_or_invalid_moe_configs_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config(_qwen3_moe_config(**overrides))


def test_other_moe_families_are_refused():
    with pytest.raises(ValueError, match="qwen3_moe only"):
        ModelArch.from_hf_config(dict(_qwen3_moe_config(), model_type="qwen2", num_local_experts=8))


@pytest.mark.parametrize(
    "parallel, match",
    [
        (dict(expert_model_parallel_size=3), "not divisible"),
        (dict(tensor_model_parallel_size=2), "needs --sequence-parallel"),
        (dict(moe_token_dispatcher="flex"), "dispatcher"),
        (dict(expert_model_parallel_size=2, moe_token_dispatcher="allgather"), "allgather needs"),
        (dict(moe_aux_loss_coeff=-1.0), "must be a finite number >= 0"),
        (dict(moe_z_loss_coeff=-0.01), "--moe-z-loss-coeff must be a finite number >= 0"),
        (dict(moe_z_loss_coeff=float("nan")), "--moe-z-loss-coeff must be a finite number >= 0"),
    ],
)
def test_bad_moe_layouts_are_refused(parallel, match):
    with pytest.raises(ValueError, match=match):
        moe_config_kwargs(get_preset("tiny-moe"), ParallelConfig(**parallel), grouped_gemm=False)


def test_expert_parallelism_needs_a_moe_model_and_divides_data_parallel():
    from megatron_prune.training.parallel import validate_layout

    with pytest.raises(ValueError, match="needs a mixture-of-experts"):
        moe_config_kwargs(get_preset("tiny"), ParallelConfig(expert_model_parallel_size=2), grouped_gemm=False)
    with pytest.raises(ValueError, match="must divide the data-parallel size"):
        validate_layout(ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2), 2)
    assert validate_layout(ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2), 4) == 2



def test_top1_with_renormalised_weight_is_refused_at_the_config(tmp_path):
    """HF's top-1 router with norm_topk_prob weights the one expert 1; Megatron's top-1 weights it
    by its probability, so the converter and the trainers refuse it reading config.json (it was
    a Megatron error naming a flag this project does not have, after --dry-run passed)."""
    import json

    from megatron_prune.model.hf_convert import read_hf_arch

    (tmp_path / "config.json").write_text(json.dumps(_qwen3_moe_config(num_experts_per_tok=1)))
    with pytest.raises(ValueError) as exc:
        read_hf_arch(str(tmp_path))
    assert str(tmp_path / "config.json") in str(exc.value)
    assert "num_experts_per_tok 1 with norm_topk_prob true" in str(exc.value)
    arch = ModelArch.from_hf_config(_qwen3_moe_config(num_experts_per_tok=1, norm_topk_prob=False))
    assert moe_config_kwargs(arch, ParallelConfig(), grouped_gemm=False)["moe_router_topk"] == 1
