"""Qwen3-MoE HF <-> Megatron conversion, verified against transformers' own model.

A random tiny Qwen3-MoE (8 experts, top-2, layer 1 dense, every parameter random) is converted at
EP=2 x TP=2 (sequence parallel) by tools/convert_hf_to_megatron.py, its logits compared with transformers at EP=2 x TP=2, PP=2 and
EP=4 (the checkpoint reshards across expert layouts on load), and exported back. The fused expert
layout (``experts.gate_up_proj`` / ``experts.down_proj``) is converted from a rewritten copy of
the same weights. Negative controls (two experts swapped, the router read transposed) go through
the same comparison. A second model, whose router does not renormalise the top-k weights
(``norm_topk_prob=false``: each chosen expert weighted by its softmax over all experts), is compared
at EP=2 x TP=2 too. One 4-rank launch does all Megatron-side work.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist import run_distributed
from tests.distributed.test_hf_conversion import _tool, logits_against_hf
from tests.unit.model.hf_models import FAKE_ASSETS, randomize

# fp32 on CPU: logits of order 1 agree to ~1e-6 (measured below); every control is far beyond.
TOLERANCE = 1e-5
LAYOUTS = {
    "ep2xtp2": dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "ep4": dict(expert_model_parallel_size=4),
}
NUM_EXPERTS = 8
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_qwen3_moe(path: str, *, seed: int = 0, norm_topk_prob: bool = True) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=NUM_EXPERTS, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    model = Qwen3MoeForCausalLM(config)
    randomize(model, seed=seed)
    model.save_pretrained(path)
    for name, text in FAKE_ASSETS.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            f.write(text)
    return path


def _state(path: str) -> dict[str, torch.Tensor]:
    from megatron_prune.model.hf_convert import HFCheckpoint

    with HFCheckpoint(path) as hf:
        return {name: hf[name] for name in hf}


def make_fused_copy(src: str, dst: str) -> str:
    """The same weights in the fused expert layout: per layer ``mlp.experts.gate_up_proj [E, 2I, h]``
    (gate rows then up rows of each expert) and ``mlp.experts.down_proj [E, h, I]``."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    state, fused = _state(src), {}
    layers = sorted({int(n.split(".")[2]) for n in state if ".mlp.experts." in n})
    for name, t in state.items():
        if ".mlp.experts." not in name:
            fused[name] = t
    for layer in layers:
        pre = f"model.layers.{layer}.mlp.experts."
        fused[pre + "gate_up_proj"] = torch.stack([
            torch.cat([state[f"{pre}{e}.gate_proj.weight"], state[f"{pre}{e}.up_proj.weight"]])
            for e in range(NUM_EXPERTS)])
        fused[pre + "down_proj"] = torch.stack([state[f"{pre}{e}.down_proj.weight"] for e in range(NUM_EXPERTS)])
    save_file(fused, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _controlled_comparison(hf_dir: str, *, change) -> object:
    """Fill the model from HF tensors altered by ``change`` and compare with transformers."""
    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import ParallelConfig

    return logits_against_hf(hf_dir, hf=change(_state(hf_dir)), arch=hf_convert.read_hf_arch(hf_dir),
                             parallel=ParallelConfig(**LAYOUTS["ep2xtp2"]))


def _swap_two_experts(state: dict) -> dict:
    pre = "model.layers.2.mlp.experts."
    swaps = {}
    for part in ("gate_proj", "up_proj", "down_proj"):
        a, b = f"{pre}0.{part}.weight", f"{pre}5.{part}.weight"
        swaps.update({a: b, b: a})
    return {swaps.get(n, n): t for n, t in state.items()}


def _router_transposed(state: dict) -> dict:
    name = "model.layers.0.mlp.gate.weight"
    return {**state, name: state[name].t().reshape(state[name].shape).contiguous()}


def conversion_suite(*, root: str, hf_dir: str, fused_dir: str, unnormalised_dir: str) -> dict:
    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import ParallelConfig

    converted, fused_converted = os.path.join(root, "megatron"), os.path.join(root, "fused-megatron")
    out: dict = {"logits": {}}
    layout = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    out["cli"] = {
        "convert": _tool("convert_hf_to_megatron").main(["--hf-dir", hf_dir, "--save", converted] + layout),
        "compare": _tool("compare_hf_megatron").main(["--hf-dir", hf_dir, "--load", converted, "--tolerance",
                                                      str(TOLERANCE)] + layout),
    }
    for name, layout in LAYOUTS.items():
        out["logits"][name] = hf_convert.compare_hf_and_megatron(
            hf_dir=hf_dir, load_dir=converted, parallel=ParallelConfig(**layout))
    hf_convert.export_megatron_to_hf(load_dir=converted, hf_out=os.path.join(root, "exported"))
    hf_convert.convert_hf_to_megatron(hf_dir=fused_dir, save_dir=fused_converted)
    out["logits"]["fused layout, ep2xtp2"] = hf_convert.compare_hf_and_megatron(
        hf_dir=hf_dir, load_dir=fused_converted, parallel=ParallelConfig(**LAYOUTS["ep2xtp2"]))
    out["logits"]["norm_topk_prob false, ep2xtp2"] = logits_against_hf(
        unnormalised_dir, hf=_state(unnormalised_dir), arch=hf_convert.read_hf_arch(unnormalised_dir),
        parallel=ParallelConfig(**LAYOUTS["ep2xtp2"]))
    out["controls"] = {
        "two experts swapped": _controlled_comparison(hf_dir, change=_swap_two_experts),
        "router read transposed": _controlled_comparison(hf_dir, change=_router_transposed),
    }
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf-moe")
    hf_dir = make_qwen3_moe(str(root / "qwen3-moe"))
    return dict(hf=hf_dir, fused=make_fused_copy(hf_dir, str(root / "qwen3-moe-fused")),
                unnormalised=make_qwen3_moe(str(root / "qwen3-moe-unnormalised"), seed=1, norm_topk_prob=False))


@pytest.fixture(scope="module")
def suite(models, tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("megatron-moe"))
    return root, run_distributed(conversion_suite, 4, root=root, hf_dir=models["hf"], fused_dir=models["fused"],
                                 unnormalised_dir=models["unnormalised"])[0]


@pytest.mark.distributed
def test_moe_logits_match_transformers(suite):
    for name, result in suite[1]["logits"].items():
        print(f"{name}: {result.summary()}")
        assert result.ok(TOLERANCE), f"{name}: {result.summary()}"
        assert result.top1_agreement == 1.0


@pytest.mark.distributed
def test_moe_tools_convert_and_compare_at_expert_parallel_layout(suite):
    """The converter and the compare tool at EP=2 x TP=2 (sequence parallel switched on for MoE)."""
    assert suite[1]["cli"] == {"convert": 0, "compare": 0}


@pytest.mark.distributed
def test_moe_negative_controls_are_flagged(suite):
    for name, result in suite[1]["controls"].items():
        print(f"{name}: {result.summary()}")
        assert result.max_abs_diff > 100 * TOLERANCE, f"{name} was not detected: {result.summary()}"


@pytest.mark.distributed
def test_moe_round_trip_is_bit_identical(suite, models):
    exported = os.path.join(suite[0], "exported")
    original, back = _state(models["hf"]), _state(exported)
    assert set(back) == set(original)
    assert any(".mlp.experts.7.down_proj." in n for n in back) and any(".mlp.gate." in n for n in back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with open(os.path.join(models["hf"], "config.json")) as f, open(os.path.join(exported, "config.json")) as g:
        assert json.load(f) == json.load(g)


def test_unsupported_moe_fields_are_refused(tmp_path):
    from megatron_prune.model.hf_mapping import arch_from_hf_config
    from megatron_prune.model.hf_convert import read_hf_config

    config = read_config_of(make_qwen3_moe(str(tmp_path / "m")))
    with pytest.raises(ValueError, match="shared experts"):
        arch_from_hf_config(dict(config, shared_expert_intermediate_size=64))
    assert read_hf_config(str(tmp_path / "m"))["model_type"] == "qwen3_moe"


def test_fused_and_per_expert_layouts_map_to_the_same_megatron_state(models):
    from megatron_prune.model.hf_convert import HFCheckpoint, read_hf_arch
    from megatron_prune.model.hf_mapping import hf_to_megatron_state, megatron_to_hf_state

    arch = read_hf_arch(models["hf"])
    with HFCheckpoint(models["hf"]) as a, HFCheckpoint(models["fused"]) as b:
        per_expert, fused = hf_to_megatron_state(a, arch), hf_to_megatron_state(b, arch)
        assert set(per_expert) == set(fused)
        assert all(torch.equal(per_expert[k], fused[k]) for k in per_expert)
        back = megatron_to_hf_state(per_expert, arch)
        assert set(back) == set(a) and all(torch.equal(back[n], a[n]) for n in back)
    assert per_expert["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"].shape == (NUM_EXPERTS, 64, 64)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in per_expert  # the dense layer


def read_config_of(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


