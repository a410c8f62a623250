"""LoRA on a mixture-of-experts model (tiny-moe, local spec, sequential experts), gloo, fp32.

Adapters sit on the attention linears and on every expert's ``linear_fc1`` / ``linear_fc2``
(one adapter per expert; the router stays frozen). Checked against the single rank: a fresh
adapter is exactly the base MoE model, and one DPO step (adapter-off reference, Adam) at EP=2,
TP=2 with SP, and (slow, 4 ranks) EP=2 x TP=2 with SP, EP=2 x DP=2 with the distributed optimizer
and EP=2 x PP=2 gives the same loss, adapter gradients (gathered to their global keys, global
expert index included) and adapters after the step, with the base weights untouched. The router losses are off
in most steps: they count every token of a microbatch, padding included, so they depend on how
rows are grouped and padded; one step with them on runs one pair per microbatch padded to one
common length (as tests/distributed/test_moe.py does), where their gradient reaches the adapters
through the router's input. A checkpoint saved at EP=2 (and EP=2 x TP=2) loads at EP=1 with the
same adapters and exports merged HF weights that transformers runs to the same logits; the
PEFT export (per-expert adapters) loaded with peft gives them too.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.dist import run_distributed
from tests.distributed.dpo_harness import SEED
from tests.distributed.test_lora import (
    LORA,
    _assert_only_adapters_train,
    _assert_step_matches,
    _is_adapter,
    _my_samples,
    _settings,
    _unwrap,
    perturb_adapters,
    saved_model_keys,
    step_and_collect,
)
from tests.distributed.test_moe import AUX, COMMON_LENGTH, Z

PRESET = "tiny-moe"
TOLERANCE = 1e-5
LAYOUTS_2 = {
    "ep2": dict(expert_model_parallel_size=2),
    "tp2-sp-allgather": dict(tensor_model_parallel_size=2, sequence_parallel=True, moe_token_dispatcher="allgather"),
    # EP=1: every expert on both ranks, each split over (expert) TP.
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
}
LAYOUTS_4 = {
    "ep2xtp2-sp": dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    # The distributed optimizer shards the dense adapters over DP=4 and the expert adapters over EDP=2.
    "ep2xdp2-distopt": dict(expert_model_parallel_size=2, distopt=True),
    "ep2xpp2": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
}
EXPERT_KEY = "decoder.layers.{layer}.mlp.experts.experts.{linear}.{adapter}"
MOE_LAYERS = (1, 2, 3)  # tiny-moe: layer 0 keeps a dense MLP


def _tokens():
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import comparison_tokens

    return comparison_tokens(vocab_size=get_preset(PRESET).vocab_size, batch_size=2, seq_length=16, seed=3)


def _swap_first_two_local_expert_adapters(policy) -> None:
    """Negative control: expert-parallel rank 1 holds the adapters of its two experts of the first
    MoE layer swapped (base weights untouched)."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_rank() != 1:
        return
    layer = next(layer for layer in _unwrap(policy[0]).decoder.layers if hasattr(layer.mlp, "router"))
    first, second = layer.mlp.experts.local_experts[:2]
    with torch.no_grad():
        for linear in ("linear_fc1", "linear_fc2"):
            for name in ("lora_A", "lora_B"):
                a, b = getattr(getattr(first, linear), name), getattr(getattr(second, linear), name)
                tmp = a.detach().clone()
                a.copy_(b)
                b.copy_(tmp)


def _frozen_report(policy, optimizer, named, base: dict) -> dict:
    """What the step did to the base and which tensors the DDP buffers and the optimizer hold
    (the fields :func:`tests.distributed.test_lora._assert_only_adapters_train` checks)."""
    adapters = [p for n, p in named if _is_adapter(n)]
    adapter_ids = {id(p) for p in adapters}
    buffered = [p for c in policy for buf in (*c.buffers, *c.expert_parallel_buffers) for p in buf.params]
    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    opt_params = [p for o in inner for g in o.param_groups for p in g["params"]]
    return {
        "base_unchanged": all(torch.equal(p, base[n]) for n, p in named if n in base),
        "base_requires_grad": [n for n, p in named if n in base and p.requires_grad],
        "base_main_grad": [n for n, p in named if n in base and hasattr(p, "main_grad")],
        "buffered_non_adapters": sum(id(p) not in adapter_ids for p in buffered),
        "buffered_adapters": sum(id(p) in adapter_ids for p in buffered),
        "expert_buffered_adapters": sum(id(p) in adapter_ids for c in policy for buf in c.expert_parallel_buffers
                                        for p in buf.params),
        "optimizer_numel": sum(p.numel() for p in opt_params),
        "adapter_numel": sum(p.numel() for p in adapters),
        "state_numel": sum(t.numel() for o in inner for s in o.state.values() for t in s.values()
                           if isinstance(t, torch.Tensor) and t.dim() > 0),
        "local_optimizer_numel": sum(p.numel() for p in opt_params),
        "expert_adapter_allreduce": sorted({bool(p.allreduce) for n, p in named
                                            if _is_adapter(n) and ".experts." in n}),
    }


def lora_moe_step(*, parallel: dict | None = None, corrupt=None, save_to: str | None = None,
                  router_losses: bool = False) -> dict:
    """One DPO step (adapter-off reference, Adam) of a LoRA tiny-moe (router losses off unless
    ``router_losses``: then one pair per microbatch, padded to one common length): loss,
    whole adapter gradients (None under the distributed optimizer, where each rank holds a slice),
    adapters after the step, logits after the step, and what the step did to the base.
    ``save_to``: save the adapters (and their optimizer state) after the step."""
    from megatron_prune.dpo.step import DPOStep
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import megatron_logits
    from megatron_prune.model.lora import LoRAConfig, adapter_off
    from megatron_prune.model.lora_base import preset_base
    from megatron_prune.model.lora_export import lora_meta
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import save_checkpoint
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    parallel = dict(parallel or {})
    distopt = parallel.pop("distopt", False)
    settings = _settings()
    if router_losses:
        parallel.update(moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z)
        settings = dataclasses.replace(settings, micro_batch_size=1, pad_multiple=COMMON_LENGTH)
    par = ParallelConfig(**parallel)
    arch = get_preset(PRESET)
    cfg = LoRAConfig(**LORA)
    with model_parallel(par, seed=SEED):
        policy = setup_model(arch, par, seed=SEED, lora=cfg, use_distributed_optimizer=distopt)
        perturb_adapters(policy)
        if corrupt is not None:
            corrupt(policy)
        optimizer = build_optimizer(
            policy, OptimConfig(optimizer="adam", lr=1e-2, adam_eps=1e-2, weight_decay=0.1, clip_grad=1.0,
                                use_distributed_optimizer=distopt), bf16=False)
        named = [(n, p) for c in policy for n, p in _unwrap(c).named_parameters()]
        base = {n: p.detach().clone() for n, p in named if not _is_adapter(n)}
        runner = DPOStep(settings=settings, policy=policy, reference=adapter_off(policy))
        metrics, grads, success, grad_norm, after = step_and_collect(runner, policy, optimizer, distopt=distopt)
        logits = megatron_logits(policy, _tokens())
        if save_to is not None:
            save_checkpoint(save_to, iteration=1, model=policy, arch=arch, optimizer=optimizer,
                            extra_meta=lora_meta(cfg, base=preset_base(PRESET, seed=SEED).to_dict()))
        frozen = _frozen_report(policy, optimizer, named, base)
    return dict(metrics=metrics, grads=grads, after=after, grad_norm=float(grad_norm), success=success,
                frozen=frozen, logits=logits)


def fresh_checks(*, parallel: dict | None = None) -> dict:
    """Logits of a fresh LoRA tiny-moe and of the base model; DPO metrics of a fresh LoRA policy
    and of the full-parameter policy against the same reference."""
    from megatron_prune.dpo.step import DPOStep
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import megatron_logits
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics

    par = ParallelConfig(**(parallel or {}))
    arch = get_preset(PRESET)
    out = {}
    with model_parallel(par, seed=SEED):
        reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
        for name, lora in (("lora", LoRAConfig(**LORA)), ("base", None)):
            policy = setup_model(arch, par, seed=SEED, lora=lora)
            out[f"{name}_logits"] = megatron_logits(policy, _tokens())
            outputs, _ = DPOStep(settings=_settings(), policy=policy, reference=reference).run(0, _my_samples())
            out[name] = reduce_metrics(outputs)
        tuned = setup_model(arch, par, seed=SEED, lora=LoRAConfig(**LORA))
        perturb_adapters(tuned)
        out["tuned_logits"] = megatron_logits(tuned, _tokens())
    return out


def reload(*, path: str, parallel: dict) -> dict:
    """A LoRA tiny-moe checkpoint loaded at another layout on the base rebuilt from its record
    (the model is built from another seed: neither base nor adapters can come from the build)."""
    from megatron_prune.lora_config import check_load
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.model.hf_convert import megatron_logits
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.lora_base import BaseSource, load_base_weights
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import load_checkpoint
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(**parallel)
    arch = get_preset(PRESET)
    base = BaseSource.from_dict(check_load(path, LoRAConfig(**LORA)))
    with model_parallel(par, seed=SEED):
        policy = setup_model(arch, par, seed=SEED + 5, lora=LoRAConfig(**LORA),
                             load_base=lambda chunks: load_base_weights(chunks, base, arch=arch))
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam"), bf16=False)
        meta = load_checkpoint(path, model=policy, arch=arch, optimizer=optimizer)
        return dict(after={k: v for k, v in gather_global_state(policy).items() if _is_adapter(k)},
                    lora=meta.get("lora"), logits=megatron_logits(policy, _tokens()))


def merged_export_bases(root: str) -> dict:
    """A LoRA tiny-moe checkpoint on a Megatron-checkpoint base and on an HF base, exported merged
    (the base's experts read whole from the checkpoint, or expert by expert from HF tensors)."""
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import export_megatron_to_hf, megatron_logits
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.lora_base import hf_base, megatron_base
    from megatron_prune.model.lora_export import export_merged, export_peft, lora_meta
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import read_meta, save_checkpoint
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    arch = get_preset(PRESET)
    cfg = LoRAConfig(**LORA)
    with model_parallel(par, seed=SEED):
        lora = setup_model(arch, par, seed=SEED, lora=cfg)
        perturb_adapters(lora)
        base_model = setup_model(arch, par, seed=SEED, trainable=False)
        save_checkpoint(f"{root}/base", iteration=1, model=base_model, arch=arch)
        export_megatron_to_hf(load_dir=f"{root}/base", hf_out=f"{root}/base_hf")
        merged = {}
        for kind, base in (("megatron", megatron_base(read_meta(f"{root}/base"))), ("hf", hf_base(f"{root}/base_hf"))):
            save_checkpoint(f"{root}/lora_{kind}", iteration=1, model=lora, arch=arch,
                            extra_meta=lora_meta(cfg, base=base.to_dict()))
            export_merged(load_dir=f"{root}/lora_{kind}", hf_out=f"{root}/merged_{kind}")
            merged[kind] = f"{root}/merged_{kind}"
        return dict(logits=megatron_logits(lora, _tokens()), merged=merged, ckpt=f"{root}/lora_hf")


def peft_export_all_sparse(root: str) -> dict:
    """A LoRA checkpoint of tiny-moe with every layer sparse, on an HF base, exported as PEFT adapters."""
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import export_megatron_to_hf, megatron_logits
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.lora_base import hf_base
    from megatron_prune.model.lora_export import export_peft, lora_meta
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import save_checkpoint
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    arch = dataclasses.replace(get_preset(PRESET), mlp_only_layers=[])
    cfg = LoRAConfig(**LORA)
    with model_parallel(par, seed=SEED):
        lora = setup_model(arch, par, seed=SEED, lora=cfg)
        perturb_adapters(lora)
        save_checkpoint(f"{root}/sparse_base", iteration=1, model=setup_model(arch, par, seed=SEED, trainable=False),
                        arch=arch)
        export_megatron_to_hf(load_dir=f"{root}/sparse_base", hf_out=f"{root}/sparse_base_hf")
        save_checkpoint(f"{root}/sparse_lora", iteration=1, model=lora, arch=arch,
                        extra_meta=lora_meta(cfg, base=hf_base(f"{root}/sparse_base_hf").to_dict()))
        export_peft(load_dir=f"{root}/sparse_lora", peft_out=f"{root}/sparse_peft")
        return dict(logits=megatron_logits(lora, _tokens()), peft=f"{root}/sparse_peft",
                    base_hf=f"{root}/sparse_base_hf")


def single_rank(root: str) -> dict:
    return dict(step=lora_moe_step(), router_losses=lora_moe_step(router_losses=True), fresh=fresh_checks(),
                export=merged_export_bases(root), peft=peft_export_all_sparse(root))


def _save_reload_export(root: str, parallel: dict) -> dict:
    """Save after a step at ``parallel``, load at EP=1 and export merged HF weights (collective)."""
    from megatron_prune.model.lora_export import export_merged

    path = f"{root}/ckpt"
    saved = lora_moe_step(parallel=parallel, save_to=path)
    export_merged(load_dir=path, hf_out=f"{root}/merged")
    return dict(saved=saved, saved_keys=saved_model_keys(path), reloaded=reload(path=path, parallel={}),
                merged=f"{root}/merged", ckpt=path)


def two_rank_checks(root: str) -> dict:
    out = {name: lora_moe_step(parallel=par) for name, par in LAYOUTS_2.items()}
    out["router-losses:ep2"] = lora_moe_step(parallel=LAYOUTS_2["ep2"], router_losses=True)
    out["swapped-expert-adapters"] = lora_moe_step(parallel=LAYOUTS_2["ep2"],
                                                   corrupt=_swap_first_two_local_expert_adapters)
    out["fresh:ep2"] = fresh_checks(parallel=LAYOUTS_2["ep2"])
    out["saved:ep2"] = _save_reload_export(root, LAYOUTS_2["ep2"])
    return out


def four_rank_checks(root: str) -> dict:
    out = {name: lora_moe_step(parallel=par) for name, par in LAYOUTS_4.items()}
    # Saved with the experts' fc1 split over TP (its B rows: [gate shard; up shard] per rank).
    out["saved:ep2xtp2-sp"] = _save_reload_export(root, LAYOUTS_4["ep2xtp2-sp"])
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_distributed(single_rank, 1, root=str(tmp_path_factory.mktemp("lora_moe_single")))[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return run_distributed(two_rank_checks, 2, root=str(tmp_path_factory.mktemp("lora_moe")))[0]


def _assert_saved_checkpoint(result: dict, label: str) -> None:
    """The checkpoint holds the adapters alone (global expert index); loaded at EP=1 it gives the
    same adapters and logits; its merged HF export (transformers' Qwen3-MoE) gives the same logits."""
    from megatron_prune.model.hf_convert import compare_logits, hf_logits

    keys = [k for k in result["saved_keys"] if not k.startswith("chained_")]  # chained optimizers at EP > 1
    assert keys and all(_is_adapter(k) for k in keys), [k for k in keys if not _is_adapter(k)][:3]
    # Per layer (keyed one by one): A and B of qkv, proj, fc1 and fc2 (a MoE layer's experts' stacked).
    assert len(keys) == 2 * 4 * 4, keys
    assert EXPERT_KEY.format(layer=1, linear="linear_fc1", adapter="lora_B") in keys
    saved, got = result["saved"], result["reloaded"]
    assert got["lora"]["rank"] == LORA["rank"] and set(got["after"]) == set(saved["after"]), label
    for key, value in saved["after"].items():
        assert torch.equal(got["after"][key], value), f"{label}: {key}"
    torch.testing.assert_close(got["logits"], saved["logits"], rtol=TOLERANCE, atol=TOLERANCE,
                               msg=lambda m: f"{label}: {m}")
    merged = compare_logits(hf_logits(result["merged"], _tokens()), saved["logits"])
    assert merged.max_abs_diff <= TOLERANCE, f"{label}: merged export: {merged.summary()}"


@pytest.mark.distributed
def test_fresh_adapter_is_the_base_moe_model(single, two_ranks):
    for label, fresh in (("single rank", single["fresh"]), ("ep2", two_ranks["fresh:ep2"])):
        assert torch.equal(fresh["lora_logits"], fresh["base_logits"]), label
        assert fresh["lora"]["loss"] == fresh["base"]["loss"], label
        assert fresh["lora"]["margin"] == fresh["base"]["margin"], label
        assert not torch.allclose(fresh["tuned_logits"], fresh["base_logits"], atol=1e-4), \
            f"{label}: adapters changed nothing"
    # Initialisation is layout independent: the same base and the same perturbed adapters at EP=2.
    torch.testing.assert_close(two_ranks["fresh:ep2"]["tuned_logits"], single["fresh"]["tuned_logits"],
                               rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.distributed
def test_every_expert_has_its_own_trained_adapter_single_rank(single):
    step = single["step"]
    _assert_only_adapters_train(step["frozen"], "single rank")
    assert step["frozen"]["expert_adapter_allreduce"] == [True], "EP=1: expert weights are reduced like the rest"
    # A and B of fc1 and fc2 of every MoE layer, stacked over the 4 experts, each expert with a gradient.
    for layer in MOE_LAYERS:
        for linear in ("linear_fc1", "linear_fc2"):
            for adapter in ("lora_A", "lora_B"):
                grad = step["grads"][EXPERT_KEY.format(layer=layer, linear=linear, adapter=adapter)]
                assert grad.shape[0] == 4 and all(float(grad[e].abs().max()) > 0 for e in range(4)), (layer, linear)
    assert not [k for k in step["grads"] if "router" in k]
    assert step["frozen"]["adapter_numel"] == sum(g.numel() for g in step["grads"].values())
    norm = sum(float(g.double().pow(2).sum()) for g in step["grads"].values()) ** 0.5
    assert step["grad_norm"] == pytest.approx(norm, rel=1e-6)


@pytest.mark.distributed
def test_lora_moe_step_at_expert_parallel_2_matches_single_rank(single, two_ranks):
    for name in LAYOUTS_2:
        _assert_step_matches(single["step"], two_ranks[name], name)
        _assert_only_adapters_train(two_ranks[name]["frozen"], name)
        # At EP > 1 the expert adapters live in Megatron's expert buffers, like their base weights.
        expert_parallel = name.startswith("ep2")
        assert two_ranks[name]["frozen"]["expert_adapter_allreduce"] == [not expert_parallel], name
        assert (two_ranks[name]["frozen"]["expert_buffered_adapters"] > 0) == expert_parallel, name
    # Negative control: two experts' adapters swapped on one EP rank are caught.
    with pytest.raises(AssertionError):
        _assert_step_matches(single["step"], two_ranks["swapped-expert-adapters"], "swapped expert adapters")


@pytest.mark.distributed
def test_router_losses_reach_the_adapters_at_expert_parallel_2(single, two_ranks):
    ref, got = single["router_losses"], two_ranks["router-losses:ep2"]
    _assert_step_matches(ref, got, "ep2 with router losses")
    for name in ("moe_aux_loss", "moe_z_loss"):
        assert ref["metrics"][name] > 0
        torch.testing.assert_close(got["metrics"][name], ref["metrics"][name], rtol=TOLERANCE, atol=1e-7)
    # The router losses changed the adapters' gradients (through the router's input), beyond rounding.
    change = max(float((ref["grads"][k] - g).abs().max() / g.abs().max()) for k, g in single["step"]["grads"].items())
    print(f"largest relative adapter-gradient change from the router losses: {change:.3g}")
    assert change > 1e-3


@pytest.mark.distributed
def test_lora_moe_checkpoint_saved_at_ep2_loads_at_ep1_and_exports_merged(two_ranks):
    from megatron_prune.model.hf_convert import compare_logits, hf_logits

    _assert_saved_checkpoint(two_ranks["saved:ep2"], "saved at EP=2")
    # Negative control: the trained adapters moved the model away from the base.
    base = compare_logits(hf_logits(two_ranks["saved:ep2"]["merged"], _tokens()), two_ranks["fresh:ep2"]["base_logits"])
    assert base.max_abs_diff > 100 * TOLERANCE


@pytest.mark.distributed
def test_merged_export_of_a_moe_lora_checkpoint_on_megatron_and_hf_bases(single):
    from megatron_prune.model.hf_convert import compare_logits, hf_logits

    for kind, merged in single["export"]["merged"].items():
        got = compare_logits(hf_logits(merged, _tokens()), single["export"]["logits"])
        assert got.max_abs_diff <= TOLERANCE, f"{kind} base: {got.summary()}"


def _swap_expert_adapters(src: str, dst: str) -> None:
    """A copy of the PEFT directory ``src`` with experts 0 and 1 of one layer trading adapters."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(f"{src}/adapter_model.safetensors")
    first = sorted(k for k in tensors if ".experts.0." in k)
    assert first, "no expert adapters in the PEFT export"
    for key in first:
        other = key.replace(".experts.0.", ".experts.1.")
        tensors[key], tensors[other] = tensors[other], tensors[key]
    save_file(tensors, f"{dst}/adapter_model.safetensors", metadata={"format": "pt"})


@pytest.mark.distributed
def test_peft_export_of_a_moe_lora_checkpoint_matches_in_peft(single, tmp_path):
    """Per-expert PEFT adapters (``mlp.experts.<e>.{gate,up,down}_proj``), which peft fuses onto
    transformers' stacked expert tensors on load, give the LoRA model's logits (every layer
    sparse); a copy with two experts' adapters swapped does not."""
    pytest.importorskip("peft")
    from megatron_prune.model.hf_convert import compare_logits
    from tests.distributed.test_lora import _peft_logits

    export = single["peft"]
    config = json.loads(open(f"{export['peft']}/adapter_config.json").read())
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"])
    got = compare_logits(_peft_logits(export["base_hf"], export["peft"], _tokens()), export["logits"])
    assert got.max_abs_diff <= TOLERANCE, got.summary()
    _swap_expert_adapters(export["peft"], str(tmp_path / "swapped"))
    swapped = compare_logits(_peft_logits(export["base_hf"], str(tmp_path / "swapped"), _tokens()), export["logits"])
    assert swapped.max_abs_diff > 100 * TOLERANCE, "swapping two experts' adapters went unnoticed"


@pytest.mark.distributed
def test_peft_export_of_a_moe_model_with_dense_mlp_layers_is_refused(single, tmp_path, capsys):
    """tiny-moe's layer 0 is dense: peft would drop its MLP adapters on load, so the tool refuses."""
    from tests.distributed.test_hf_conversion import _tool

    merged, peft = tmp_path / "merged", tmp_path / "peft"
    with pytest.raises(SystemExit) as exc:
        _tool("convert_megatron_to_hf").main(["--load", single["export"]["ckpt"], "--hf-out", str(merged),
                                              "--merge-lora", "--peft-out", str(peft)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "dense MLP layers [0]" in err and "--merge-lora" in err, err
    assert not merged.exists() and not peft.exists(), "refused before writing anything"


@pytest.mark.slow  # four gloo ranks on a small CPU machine
@pytest.mark.distributed
def test_lora_moe_step_at_ep2_x_tp2_sp_matches_single_rank(single, tmp_path):
    results = run_distributed(four_rank_checks, 4, root=str(tmp_path))[0]
    for name in LAYOUTS_4:
        _assert_step_matches(single["step"], results[name], name)
        frozen = results[name]["frozen"]
        if name.endswith("distopt"):  # each rank's optimizer holds a shard: its state is that shard's moments
            assert frozen["base_unchanged"] and not frozen["base_main_grad"] and not frozen["buffered_non_adapters"]
            assert frozen["state_numel"] == 2 * frozen["local_optimizer_numel"] > 0, name
        else:
            _assert_only_adapters_train(frozen, name)
    _assert_saved_checkpoint(results["saved:ep2xtp2-sp"], "saved at EP=2 x TP=2")


@pytest.mark.e2e
def test_lora_dpo_and_grpo_clis_on_moe_at_expert_parallel_2(tmp_path):
    """The CLIs with --lora-rank on tiny-moe at EP=2: DPO saves adapters-only checkpoints that
    resume at EP=1 and export merged; GRPO (KV-cached sampler, adapter-off KL reference) runs."""
    from tests.e2e.conftest import read_jsonl
    from tests.e2e.test_dpo_cli import run_cli
    from tests.e2e.test_grpo_cli import TOY, run_grpo

    lora = ["--model-preset", "tiny-moe", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3"]
    rows = run_cli(tmp_path, *lora, "--expert-model-parallel-size", "2", "--train-iters", "2",
                   "--global-batch-size", "4", "--micro-batch-size", "1", "--prune-branch",
                   "--save", str(tmp_path / "ckpt"), nproc=2)
    assert [r["step"] for r in rows] == [0, 1]
    resumed_dir = tmp_path / "ep1"
    resumed_dir.mkdir()
    resumed = run_cli(resumed_dir, *lora, "--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "1",
                      "--prune-branch", "--load", str(tmp_path / "ckpt"))
    assert [r["step"] for r in resumed] == [2]
    assert saved_model_keys(str(tmp_path / "ckpt")) and all(
        _is_adapter(k) for k in saved_model_keys(str(tmp_path / "ckpt")) if "optimizer." not in k)

    metrics = tmp_path / "grpo.jsonl"
    toy = [a if a != "tiny" else "tiny-moe" for a in TOY]
    run_grpo([*toy, "--micro-batch-size", "8", "--lora-rank", "4", "--kl-beta", "0.1", "--kv-cache",
              "--train-iters", "2", "--expert-model-parallel-size", "2", "--metrics-jsonl", str(metrics)],
             log=tmp_path / "grpo.log").check_ok()
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == [0, 1] and records[-1]["kl"] > 0


@pytest.mark.parametrize("kind", ["GroupedMLP", "TEGroupedMLP"])
def test_grouped_gemm_experts_are_refused(kind):
    """LoRA models use the local spec; grouped-GEMM experts (which hold no per-expert linears for an
    adapter) are refused by name instead of being left without adapters."""
    import megatron.core.transformer.moe.experts as experts

    from megatron_prune.model.lora import LoRAConfig, apply_lora

    grouped = getattr(experts, kind).__new__(getattr(experts, kind))
    torch.nn.Module.__init__(grouped)
    chunk = torch.nn.Module()
    chunk.add_module("experts", grouped)
    with pytest.raises(ValueError, match=f"LoRA on experts: grouped-GEMM experts \\({kind}\\).*local layer spec"):
        apply_lora([chunk], LoRAConfig(**LORA), seed=SEED)
