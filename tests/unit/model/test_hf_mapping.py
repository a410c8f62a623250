"""HF <-> Megatron tensor mapping, safetensors reading/writing and the clear errors (one process, no Megatron)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_prune.model import hf_convert, hf_mapping
from megatron_prune.model.hf_convert import HFCheckpoint
from megatron_prune.model.hf_mapping import arch_from_hf_config, hf_to_megatron_state, megatron_to_hf_state
from tests.unit.model.hf_models import FAKE_ASSETS, KINDS, MOE_KINDS, VOCAB, hf_config, make_hf_model, read_config


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {kind: make_hf_model(kind, str(root / kind), seed=i) for i, kind in enumerate(KINDS + MOE_KINDS)}
    dirs["qwen2-bf16-sharded"] = make_hf_model("qwen2", str(root / "qwen2-bf16"), seed=9, dtype=torch.bfloat16,
                                               max_shard_size="40KB")
    return dirs


def _arch(path: str):
    return arch_from_hf_config(read_config(path))


@pytest.mark.parametrize("kind", KINDS + MOE_KINDS + ("qwen2-bf16-sharded",))
def test_round_trip_is_bit_identical(hf_dirs, kind):
    arch = _arch(hf_dirs[kind])
    with HFCheckpoint(hf_dirs[kind]) as hf:
        whole = hf_to_megatron_state(hf, arch)
        back = megatron_to_hf_state(whole, arch)
        assert list(back) == list(hf_mapping.expected_hf_shapes(arch))
        assert set(back) == set(hf)
        for name in hf:
            assert back[name].dtype == hf[name].dtype and torch.equal(back[name], hf[name]), name
    assert {k: tuple(v.shape) for k, v in whole.items()} == hf_mapping.megatron_shapes(arch)


def test_architecture_features_are_read(hf_dirs):
    archs = {kind: _arch(hf_dirs[kind]) for kind in KINDS}
    assert archs["qwen3"].qk_norm and not archs["qwen3"].tie_word_embeddings
    assert archs["qwen3-tied"].tie_word_embeddings
    assert archs["qwen2"].qkv_bias and not archs["qwen2"].qk_norm
    assert archs["llama"].rope_scaling["rope_type"] == "llama3" and archs["llama"].rope_theta == 500000.0
    assert archs["mistral"].num_key_value_heads == 2
    with HFCheckpoint(hf_dirs["qwen3-tied"]) as hf:
        whole = hf_to_megatron_state(hf, archs["qwen3-tied"])
    assert hf_mapping.OUTPUT not in whole


def test_qkv_is_interleaved_per_query_group():
    arch = hf_mapping.ModelArch(vocab_size=8, hidden_size=1, intermediate_size=1, num_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=1)
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    qkv = hf_mapping.interleave_qkv(q, k, v, arch=arch)
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.flatten().tolist() for t in hf_mapping.split_qkv(qkv, arch=arch)] == [[0, 1, 2, 3], [10, 11], [20, 21]]
    bias = hf_mapping.interleave_qkv(q.flatten(), k.flatten(), v.flatten(), arch=arch)
    assert bias.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_gate_up_and_padding(hf_dirs):
    arch = _arch(hf_dirs["llama"])
    with HFCheckpoint(hf_dirs["llama"]) as hf:
        whole = hf_to_megatron_state(hf, arch)
        f = arch.intermediate_size
        assert torch.equal(whole[hf_mapping.FC1][1, :f], hf["model.layers.1.mlp.gate_proj.weight"])
        assert torch.equal(whole[hf_mapping.FC1][1, f:], hf["model.layers.1.mlp.up_proj.weight"])
        assert torch.equal(whole[hf_mapping.INPUT_NORM][0], hf["model.layers.0.input_layernorm.weight"])
        assert torch.equal(whole[hf_mapping.PRE_MLP_NORM][0], hf["model.layers.0.post_attention_layernorm.weight"])
    for key in (hf_mapping.EMBED, hf_mapping.OUTPUT):
        assert whole[key].shape == (1024, arch.hidden_size)
        assert whole[key][VOCAB:].abs().sum() == 0 and whole[key][:VOCAB].abs().sum() > 0


# --- clear errors ------------------------------------------------------------------------------


def test_unsupported_model_type_names_it(tmp_path):
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        hf_convert.read_hf_arch(str(path))
    with pytest.raises(ValueError, match="gpt2"):  # before any distributed start-up
        hf_convert.convert_hf_to_megatron(hf_dir=str(path), save_dir=str(tmp_path / "out"))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), "yarn"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                               "rope_theta": 10000.0}), "low_freq_factor"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.5}), "rope_theta"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_llama_fields_are_refused(change, message):
    config = hf_config("llama").to_dict()
    config.update(change)
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(config)


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"type": "default"}, {}])
def test_a_rope_dict_of_the_default_type_is_no_scaling(rope):
    config = hf_config("mistral").to_dict()
    config.pop("rope_parameters", None)
    config.update(rope_theta=10000.0, rope_scaling=rope)
    arch = arch_from_hf_config(config)
    assert arch.rope_scaling is None and arch.rope_theta == 10000.0


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
         "rope_theta=10000.0 and rope_parameters.rope_theta=500000.0 differ"),
        (dict(rope_parameters={"type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), "type 'yarn'"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0},
              max_position_embeddings=4096), r"max_position_embeddings \(the original context"),
        (dict(original_max_position_embeddings=4096), "original_max_position_embeddings=4096"),
    ],
    ids=["theta-twice", "legacy-type-key", "llama3-original-from-context", "llama3-original-top-level"],
)
def test_rope_fields_are_read_as_transformers_reads_them(change, message):
    config = hf_config("llama").to_dict()
    config.update(change)
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(config)


@pytest.mark.parametrize("kind, bias", [("qwen2", True), ("mistral", False)])
def test_qwen2_and_mistral_ignore_attention_bias_as_transformers_does(kind, bias):
    config = hf_config(kind).to_dict()
    config.update(attention_bias=not bias)
    assert arch_from_hf_config(config).qkv_bias is bias


@pytest.mark.parametrize("kind, expected", [("llama", 2048), ("mistral", 131072), ("qwen2", 32768), ("qwen3", 32768)])
def test_a_missing_context_length_takes_transformers_default(kind, expected):
    config = hf_config(kind).to_dict()
    config.pop("max_position_embeddings")
    if kind == "llama":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert arch_from_hf_config(config).max_position_embeddings == expected


@pytest.mark.parametrize("field", ["head_dim", "num_key_value_heads"])
@pytest.mark.parametrize("kind", KINDS + MOE_KINDS)
def test_a_missing_attention_size_is_read_as_transformers_reads_it(kind, field):
    """config.json without ``head_dim`` or ``num_key_value_heads``: the sizes transformers builds the
    model with (its config class's defaults differ by model type: Qwen3's head_dim is 128)."""
    config = hf_config(kind, num_attention_heads=32, num_key_value_heads=4).to_dict()
    config.pop(field, None)
    reference = type(hf_config(kind)).from_dict(config)
    arch = arch_from_hf_config(config)
    assert arch.num_key_value_heads == reference.num_key_value_heads
    assert arch.head_dim == (getattr(reference, "head_dim", None) or reference.hidden_size // reference.num_attention_heads)


def test_sliding_window_is_refused():
    config = hf_config("mistral").to_dict()
    config.update(sliding_window=128)
    with pytest.raises(ValueError, match="sliding_window=128"):
        arch_from_hf_config(config)
    config = hf_config("qwen2").to_dict()
    config.update(layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="sliding_attention"):
        arch_from_hf_config(config)


def _state(hf_dir: str) -> dict[str, torch.Tensor]:
    with HFCheckpoint(hf_dir) as hf:
        return dict(hf.items())


def test_missing_tensor_is_named(hf_dirs):
    state = _state(hf_dirs["qwen3"])
    del state["model.layers.2.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.2\.self_attn\.k_norm\.weight"):
        hf_to_megatron_state(state, _arch(hf_dirs["qwen3"]))


def test_unexpected_tensor_is_named(hf_dirs):
    state = _state(hf_dirs["mistral"])
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # a buffer: ignored
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) model\.layers\.0\.self_attn\.o_proj\.bias:"):
        hf_to_megatron_state(state, _arch(hf_dirs["mistral"]))


def test_wrong_shape_names_tensor_and_shapes(hf_dirs):
    state = _state(hf_dirs["qwen2"])
    state["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(16)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias has shape \[16\], expected \[32\]"):
        hf_to_megatron_state(state, _arch(hf_dirs["qwen2"]))


def test_tied_lm_head_must_equal_the_embedding(hf_dirs):
    arch = _arch(hf_dirs["qwen3-tied"])
    state = _state(hf_dirs["qwen3-tied"])
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    hf_to_megatron_state(state, arch)  # a stored copy of the tied weight is fine
    state["lm_head.weight"] += 1
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_to_megatron_state(state, arch)


def test_megatron_side_errors_name_the_key(hf_dirs):
    arch = _arch(hf_dirs["qwen2"])
    with HFCheckpoint(hf_dirs["qwen2"]) as hf:
        whole = hf_to_megatron_state(hf, arch)
    bad = dict(whole)
    del bad[hf_mapping.QKV_BIAS]
    with pytest.raises(ValueError, match="missing decoder.layers.self_attention.linear_qkv.bias"):
        megatron_to_hf_state(bad, arch)
    bad = dict(whole, **{hf_mapping.FC2: whole[hf_mapping.FC2][:, :, :10]})
    with pytest.raises(ValueError, match=r"linear_fc2.weight has shape \[2, 64, 10\], expected \[2, 64, 96\]"):
        megatron_to_hf_state(bad, arch)


def test_reader_errors(tmp_path, hf_dirs):
    empty = tmp_path / "bin-only"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safe_serialization=True"):
        HFCheckpoint(str(empty))
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        hf_convert.read_hf_config(str(empty))
    sharded = hf_dirs["qwen2-bf16-sharded"]
    index = json.load(open(os.path.join(sharded, hf_convert.SAFETENSORS_INDEX)))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / hf_convert.SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-.*listed in"):
        HFCheckpoint(str(broken))


def test_reader_is_lazy_and_reports_shapes_and_dtypes(hf_dirs):
    with HFCheckpoint(hf_dirs["qwen2-bf16-sharded"]) as hf:
        assert len(hf.files()) > 1
        assert hf.shapes()["model.embed_tokens.weight"] == (VOCAB, 64)
        assert hf.dtype("model.norm.weight") == torch.bfloat16
        assert "model.layers.1.mlp.up_proj.weight" in hf and "lm_head.bias" not in hf
        assert hf_convert.resolve_dtype("auto", config={}, hf=hf) == torch.bfloat16
    assert hf_convert.resolve_dtype("auto", config={"torch_dtype": "float16"}) == torch.float32
    assert hf_convert.resolve_dtype("bf16", config={"dtype": "float32"}) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        hf_convert.resolve_dtype("fp16", config={})


# --- writing HF directories --------------------------------------------------------------------


def test_sharded_writer_round_trips(tmp_path, hf_dirs):
    arch = _arch(hf_dirs["qwen3"])
    state = _state(hf_dirs["qwen3"])
    shapes = hf_mapping.expected_hf_shapes(arch)
    plan = hf_convert.plan_shards(shapes, dtype=torch.float32, max_shard_bytes=50_000)
    assert len(plan.files) > 3 and plan.total_size == sum(t.numel() * 4 for t in state.values())
    writer = hf_convert.ShardWriter(str(tmp_path), plan)
    for name in reversed(list(shapes)):  # any order: a file is written once complete
        writer.add(name, state[name])
    writer.finish()
    (tmp_path / "config.json").write_text("{}")
    back = _state(str(tmp_path))
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
    single = hf_convert.plan_shards(shapes, dtype=torch.bfloat16, max_shard_bytes=10**9)
    assert single.files == ["model.safetensors"]


def test_parse_size():
    assert hf_convert.parse_size("5GB") == 5 * 10**9
    assert hf_convert.parse_size("4GiB") == 4 * 2**30
    assert hf_convert.parse_size("500MB") == 500 * 10**6
    assert hf_convert.parse_size("1234") == 1234
    with pytest.raises(ValueError, match="--max-shard-size"):
        hf_convert.parse_size("big")


def test_assets_are_copied_but_never_weights(tmp_path, hf_dirs):
    copied = hf_convert.copy_hf_assets(hf_dirs["qwen2-bf16-sharded"], str(tmp_path))
    assert set(copied) == set(FAKE_ASSETS) | {"config.json", "generation_config.json"}
    assert not any(n.endswith(".safetensors") or n.endswith(".index.json") for n in os.listdir(tmp_path))


def test_export_config_keeps_the_original_and_sets_dtype(hf_dirs):
    arch = _arch(hf_dirs["llama"])
    config = hf_convert.export_config(arch, assets=hf_dirs["llama"], dtype=torch.bfloat16)
    original = read_config(hf_dirs["llama"])
    assert config == dict(original, dtype="bfloat16")
    with pytest.raises(ValueError, match="different model"):
        hf_convert.export_config(_arch(hf_dirs["mistral"]), assets=hf_dirs["llama"], dtype=torch.float32)


@pytest.mark.parametrize("kind", KINDS + MOE_KINDS)
def test_config_made_from_arch_describes_the_same_model(kind, hf_dirs):
    """Without the original config, export writes one that transformers builds into the same model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = _arch(hf_dirs[kind])
    made = hf_mapping.hf_config_from_arch(arch)
    assert arch_from_hf_config(made) == arch
    config = AutoConfig.for_model(**made)
    model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    # A MoE model's experts as the converter reads them (per expert, whichever layout transformers holds).
    shapes = (hf_mapping.PerExpertView(state, arch).shapes() if arch.is_moe
              else {n: tuple(t.shape) for n, t in state.items()})
    hf_mapping.check_hf_tensors(shapes, arch, source=kind)
    assert arch_from_hf_config(config.to_dict()) == arch


def test_compare_logits_flags_differences():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 4, 10, generator=gen)
    padded = torch.cat([ref, torch.zeros(2, 4, 6)], dim=-1)
    same = hf_convert.compare_logits(ref, padded)
    assert same.max_abs_diff == 0 and same.kl_mean == 0 and same.top5_agreement == 1 and same.ok(1e-6)
    off = hf_convert.compare_logits(ref, padded + torch.linspace(0, 1e-3, 16))
    assert not off.ok(1e-4) and off.max_abs_diff == pytest.approx(6e-4, rel=1e-3)
    assert not hf_convert.compare_logits(ref, padded * float("nan")).ok(1e-4)
    with pytest.raises(ValueError, match="cannot be compared"):
        hf_convert.compare_logits(ref, ref[..., :5])


def test_qk_norm_weights_map_by_name(hf_dirs):
    """Qwen3's q_norm goes to Megatron's q_layernorm and k_norm to k_layernorm, layer by layer (a
    swap of the two would round-trip bit-identically, so it is checked by name)."""
    arch = _arch(hf_dirs["qwen3"])
    with HFCheckpoint(hf_dirs["qwen3"]) as hf:
        whole = hf_to_megatron_state(hf, arch)
        for layer in range(arch.num_layers):
            attn = f"model.layers.{layer}.self_attn."
            assert not torch.equal(hf[attn + "q_norm.weight"], hf[attn + "k_norm.weight"])
            assert torch.equal(whole[hf_mapping.Q_NORM][layer], hf[attn + "q_norm.weight"])
            assert torch.equal(whole[hf_mapping.K_NORM][layer], hf[attn + "k_norm.weight"])


def test_padded_vocab_size_is_the_next_multiple():
    assert hf_mapping.padded_vocab_size(300) == 1024
    assert hf_mapping.padded_vocab_size(1024) == 1024  # already a multiple: no extra block
    assert hf_mapping.padded_vocab_size(1025) == 2048
    assert hf_mapping.padded_vocab_size(151936) == 151552 + 1024  # Qwen's vocabulary: 148 * 1024 + 384
    assert hf_mapping.padded_vocab_size(128, multiple=128) == 128


def test_config_made_from_arch_keeps_non_default_norm_eps_and_head_dim():
    """A Llama-3-style eps (1e-5, not transformers' 1e-6 default) and a Qwen3-style head_dim
    (not hidden_size / heads) survive an export that has to write its own config.json."""
    from transformers import AutoConfig

    arch = hf_mapping.ModelArch(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96,
                                num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                rms_norm_eps=1e-5, qk_norm=True)
    config = AutoConfig.for_model(**hf_mapping.hf_config_from_arch(arch))
    assert config.rms_norm_eps == 1e-5 and config.head_dim == 32
    assert arch_from_hf_config(config.to_dict()) == arch


def test_shard_may_reach_exactly_the_size_limit():
    """Like transformers' own sharding, a file may hold tensors that add up to exactly the limit;
    a new file starts only when the next tensor would go over it."""
    shapes = {"a": (5,), "b": (5,), "c": (1,)}  # float32: 20 + 20 + 4 bytes
    assert hf_convert.plan_shards(shapes, dtype=torch.float32, max_shard_bytes=40).file_of == {
        "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}
    assert hf_convert.plan_shards(shapes, dtype=torch.float32, max_shard_bytes=44).files == ["model.safetensors"]


def test_compare_logits_kl_is_hf_to_megatron():
    """``kl_mean`` is KL(softmax HF || softmax Megatron), as torch's kl_div computes it."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1)
    ref, got = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64), torch.randn(2, 3, 7, generator=gen, dtype=torch.float64)
    expected = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    reverse = F.kl_div(ref.log_softmax(-1), got.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    assert abs(float(expected) - float(reverse)) > 1e-3  # the two directions differ on these logits
    assert hf_convert.compare_logits(ref, got).kl_mean == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize("config, dtype", [
    ({"torch_dtype": "bfloat16"}, torch.bfloat16),  # transformers 4.x writes torch_dtype
    ({"dtype": "bfloat16"}, torch.bfloat16),  # transformers 5 writes dtype
    ({"dtype": "bfloat16", "torch_dtype": "float32"}, torch.bfloat16),
    ({"torch_dtype": "float16"}, torch.float32),  # fp16 is upcast
    ({}, torch.float32),
])
def test_auto_dtype_reads_either_config_key(config, dtype):
    assert hf_convert.resolve_dtype("auto", config=config) == dtype


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied", "tiny-moe"])
def test_export_steps_read_every_rule_once_a_layer_at_a_time(preset):
    """The plan both streaming exports (plain and merged LoRA) follow: every rule in one step (a
    layer-stacked one once per layer), and no step holds more than one layer's keys."""
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import export_steps
    from megatron_prune.model.hf_mapping import tensor_rules

    arch = get_preset(preset)
    seen = [(rule.megatron_key, layer) for rules, layer in export_steps(arch) for rule in rules]
    expected = [(r.megatron_key, layer) for r in tensor_rules(arch)
                for layer in (range(arch.num_layers) if r.layered else [None])]
    assert sorted(seen, key=str) == sorted(expected, key=str) and len(set(seen)) == len(seen)
    for rules, layer in export_steps(arch):
        assert len({r.layer for r in rules if r.layer is not None}) <= 1


def test_an_export_that_fails_midway_leaves_no_directory(tmp_path):
    """A write that fails part-way (here the tensor source, as a full disk would) removes the staging
    directory: neither the output nor a partial ``.tmp`` copy stays behind."""
    from megatron_prune.model.arch import get_preset

    arch = get_preset("tiny")
    out = tmp_path / "hf"

    def tensors():
        yield "model.embed_tokens.weight", torch.zeros(arch.vocab_size, arch.hidden_size)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        hf_convert.write_hf_directory(hf_out=str(out), ckpt=str(tmp_path / "ckpt"), arch=arch,
                                      out_dtype=torch.float32, hf_assets=None, max_shard_size=1 << 30,
                                      tensors=tensors())
    assert sorted(os.listdir(tmp_path)) == []
