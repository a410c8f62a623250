"""LoRA on Megatron's parallel linears (gloo): exactness of a fresh adapter, the adapter-off
reference, and one DPO step at every layout against the single-rank step."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.dist import every_rank, run_distributed
from tests.distributed.dpo_harness import SEED, sample_pairs

LORA = dict(rank=4, alpha=8.0)
EXPORT_TOLERANCE = 1e-5
ADAPTER_KEYS = (".lora_A", ".lora_B")


def _is_adapter(key: str) -> bool:
    return key.endswith(ADAPTER_KEYS)


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


@torch.no_grad()
def perturb_adapters(chunks, *, seed: int = 7) -> None:
    """Give every ``B`` a non-zero value, layout-independently (whole tensor from a keyed
    generator, each rank its slice), so adapters change the output and ``A`` gets a gradient."""
    from megatron_prune.model.init import global_slice, iter_sharded_tensors

    for chunk in chunks:
        for sh in iter_sharded_tensors(_unwrap(chunk).sharded_state_dict()):
            if not sh.key.endswith(".lora_B"):
                continue
            p = sh.prepend_axis_num
            digest = hashlib.sha256(f"{seed}|{sh.key}|{tuple(sh.global_offset[:p])}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            full = torch.randn(tuple(sh.global_shape[p:]), generator=gen) * 0.05
            sh.data.copy_(global_slice(sh, full))


def _settings(prune: dict | None = None, layout: str = "concat", pack_rows: bool = False):
    from megatron_prune.config import DPOConfig, PruneConfig
    from megatron_prune.dpo.step import DPOStepSettings

    _, pad_id = sample_pairs()
    prune_cfg = PruneConfig(**{**dict(position_ratio=1.0, seq_min_ratio=1.0, branch=False), **(prune or {})})
    return DPOStepSettings(dpo=DPOConfig(layout=layout, pack_rows=pack_rows), prune=prune_cfg, seed=SEED,
                           micro_batch_size=2, pad_id=pad_id)


def _my_samples():
    from megatron.core import parallel_state

    from megatron_prune.data.sampler import dp_shard

    samples, _ = sample_pairs()
    return dp_shard(samples, dp_rank=parallel_state.get_data_parallel_rank(),
                    dp_size=parallel_state.get_data_parallel_world_size())


def step_and_collect(runner, policy, optimizer, *, distopt: bool) -> tuple:
    """Step 0 of the DPO ``runner`` and one optimizer step: metrics, whole adapter gradients (None
    under the distributed optimizer, which reduce-scatters: each DP rank holds only its shard's
    summed gradient), success, grad norm, and the adapters after the step."""
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.training.step import reduce_metrics

    for chunk in policy:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs, _ = runner.run(0, _my_samples())
    metrics = reduce_metrics(outputs)
    grads = None if distopt else {
        k: v for k, v in gather_global_state(policy, source="main_grad").items() if _is_adapter(k)
    }
    success, grad_norm, _ = optimizer.step()
    after = {k: v for k, v in gather_global_state(policy).items() if _is_adapter(k)}
    return metrics, grads, success, grad_norm, after


def lora_step(*, parallel: dict | None = None, distopt: bool = False, prune: dict | None = None,
              lora: dict | None = None, branch_pattern: tuple[int, ...] | None = None,
              save_to: str | None = None, layout: str = "concat", pack_rows: bool = False) -> dict:
    """One DPO step (adapter-off reference, Adam) of a LoRA model: loss, adapter gradients, grad
    norm and adapters after the step (whole tensors), and what the step did to the base."""
    from megatron.core import parallel_state

    from megatron_prune.dpo.step import DPOStep
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.lora import LoRAConfig, adapter_off
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(**(parallel or {}))
    with model_parallel(par, seed=SEED):
        policy = setup_model(get_preset("tiny"), par, seed=SEED, use_distributed_optimizer=distopt,
                             lora=LoRAConfig(**(lora or LORA)))
        perturb_adapters(policy)
        # A large eps keeps Adam's first update a smooth function of the gradient (no sign(g)).
        optimizer = build_optimizer(
            policy, OptimConfig(optimizer="adam", lr=1e-2, adam_eps=1e-2, weight_decay=0.1, clip_grad=1.0,
                                use_distributed_optimizer=distopt), bf16=False)
        named = [(n, p) for c in policy for n, p in _unwrap(c).named_parameters()]
        base = {n: p.detach().clone() for n, p in named if not _is_adapter(n)}
        adapters = [p for n, p in named if _is_adapter(n)]
        assert base and adapters
        runner = DPOStep(settings=_settings(prune, layout, pack_rows), policy=policy, reference=adapter_off(policy))
        if branch_pattern is not None:
            plan = runner.plan

            def forced(step, samples):
                plans = plan(step, samples)
                for p in plans:
                    p.kept_branch = branch_pattern[p.sample_id]
                return plans

            runner.plan = forced
        metrics, grads, success, grad_norm, after = step_and_collect(runner, policy, optimizer, distopt=distopt)
        logits = None
        if save_to is not None:
            from megatron_prune.model.hf_convert import comparison_tokens, megatron_logits

            logits = megatron_logits(policy, comparison_tokens(vocab_size=get_preset("tiny").vocab_size,
                                                               batch_size=2, seq_length=16, seed=3))
            from megatron_prune.model.lora_export import lora_meta
            from megatron_prune.training.checkpoint import save_checkpoint

            from megatron_prune.model.lora_base import preset_base

            save_checkpoint(save_to, iteration=1, model=policy, arch=get_preset("tiny"), optimizer=optimizer,
                            extra_meta=lora_meta(LoRAConfig(**(lora or LORA)),
                                                 base=preset_base("tiny", seed=SEED).to_dict()))

        adapter_ids = {id(p) for p in adapters}
        buffered = [p for c in policy for buf in c.buffers for p in buf.params]
        inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        opt_params = [p for o in inner for g in o.param_groups for p in g["params"]]
        opt_numel = torch.tensor(float(sum(p.numel() for p in opt_params)))
        state_numel = sum(t.numel() for o in inner for s in o.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
        if distopt:
            torch.distributed.all_reduce(opt_numel, group=parallel_state.get_data_parallel_group())
        frozen = {
            "base_unchanged": all(torch.equal(p, base[n]) for n, p in named if n in base),
            "base_requires_grad": [n for n, p in named if n in base and p.requires_grad],
            "base_main_grad": [n for n, p in named if n in base and hasattr(p, "main_grad")],
            "buffered_non_adapters": sum(id(p) not in adapter_ids for p in buffered),
            "buffered_adapters": sum(id(p) in adapter_ids for p in buffered),
            "optimizer_numel": int(opt_numel),
            "adapter_numel": sum(p.numel() for p in adapters),
            "state_numel": state_numel,
            "local_optimizer_numel": sum(p.numel() for p in opt_params),
        }
        # Every TP rank must hold the same replicated adapter weights after the step.
        replicas_agree = True
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            for p in adapters:
                if getattr(p, "tensor_model_parallel", False):
                    continue
                copies = [torch.empty_like(p) for _ in range(tp_group.size())]
                torch.distributed.all_gather(copies, p.detach().contiguous(), group=tp_group)
                replicas_agree &= all(torch.equal(c, copies[0]) for c in copies)
    return dict(metrics=metrics, grads=grads, after=after, grad_norm=float(grad_norm), success=success,
                frozen=frozen, replicas_agree=replicas_agree, logits=logits)


def reference_checks(*, parallel: dict | None = None) -> dict:
    """Reference log-probs from the adapter-off view, from a separate frozen base model, and
    with adapters on; logits of a fresh LoRA model and of the base model."""
    from megatron_prune.dpo.step import DPOStep
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import comparison_tokens, megatron_logits
    from megatron_prune.model.lora import LoRAConfig, adapter_off
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(**(parallel or {}))
    arch = get_preset("tiny")
    with model_parallel(par, seed=SEED):
        tokens = comparison_tokens(vocab_size=arch.vocab_size, batch_size=2, seq_length=16, seed=3)
        lora = setup_model(arch, par, seed=SEED, lora=LoRAConfig(**LORA))
        base = setup_model(arch, par, seed=SEED, trainable=False)
        fresh_logits, base_logits = megatron_logits(lora, tokens), megatron_logits(base, tokens)
        perturb_adapters(lora)
        tuned_logits = megatron_logits(lora, tokens)
        settings = _settings()
        runner = DPOStep(settings=settings, policy=lora, reference=base)
        plans = runner.plan(0, _my_samples())
        found = {
            "adapter_off": DPOStep(settings=settings, policy=lora, reference=adapter_off(lora)).reference_logps(plans),
            "frozen_copy": runner.reference_logps(plans),
            "adapters_on": DPOStep(settings=settings, policy=lora, reference=lora).reference_logps(plans),
        }
        # Forward-only passes that score for themselves (a reference with adapters on, GRPO's old
        # log-probs) run in train mode and must score without adapter dropout.
        from megatron_prune.model.lora import lora_modules

        for module in lora_modules(lora):
            module.lora_dropout = 0.3
        assert all(chunk.training for chunk in lora)
        found["dropout_no_grad"] = DPOStep(settings=settings, policy=lora, reference=lora).reference_logps(plans)
        for module in lora_modules(lora):
            module.lora_dropout = 0.0
        # The view switched the adapters back on afterwards.
        after_logits = megatron_logits(lora, tokens)
    return dict(fresh_logits=fresh_logits, base_logits=base_logits, tuned_logits=tuned_logits,
                after_logits=after_logits, logps=found)


def fresh_dpo_loss() -> dict:
    """DPO loss of a fresh LoRA policy and of the full-parameter policy (same reference)."""
    from megatron_prune.dpo.step import DPOStep
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics

    par = ParallelConfig()
    arch = get_preset("tiny")
    out = {}
    with model_parallel(par, seed=SEED):
        reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
        for name, lora in (("lora", LoRAConfig(**LORA)), ("base", None)):
            policy = setup_model(arch, par, seed=SEED, lora=lora)
            outputs, _ = DPOStep(settings=_settings(), policy=policy, reference=reference).run(0, _my_samples())
            out[name] = reduce_metrics(outputs)
    return out


def reload(*, path: str, parallel: dict, distopt: bool = False) -> dict:
    """A LoRA checkpoint loaded (adapters with their optimizer state) at another layout, on the
    base rebuilt from the checkpoint's record (the model is built from another seed, so neither
    base nor adapters can come from the build)."""
    from megatron_prune.lora_config import check_load
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.model.hf_convert import comparison_tokens, megatron_logits
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.lora_base import BaseSource, load_base_weights
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import load_checkpoint
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(**parallel)
    arch = get_preset("tiny")
    base = BaseSource.from_dict(check_load(path, LoRAConfig(**LORA)))
    with model_parallel(par, seed=SEED):
        policy = setup_model(arch, par, seed=SEED + 5, use_distributed_optimizer=distopt, lora=LoRAConfig(**LORA),
                             load_base=lambda chunks: load_base_weights(chunks, base, arch=arch))
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam", use_distributed_optimizer=distopt),
                                    bf16=False)
        meta = load_checkpoint(path, model=policy, arch=arch, optimizer=optimizer)
        logits = megatron_logits(policy, comparison_tokens(vocab_size=arch.vocab_size, batch_size=2, seq_length=16,
                                                           seed=3))
        return dict(after={k: v for k, v in gather_global_state(policy).items() if _is_adapter(k)},
                    lora=meta.get("lora"), logits=logits)


def saved_model_keys(path: str) -> list[str]:
    """Model tensor keys of the newest checkpoint under ``path`` (optimizer state left out)."""
    import os

    from megatron.core import dist_checkpointing

    from megatron_prune.training.checkpoint import find_latest

    keys = dist_checkpointing.load_tensors_metadata(os.path.join(find_latest(path), "dist"))
    return sorted(k for k in keys if not k.startswith("optimizer."))


LAYOUTS_2 = {
    "dp2": dict(parallel={}),
    "dp2-distopt": dict(parallel={}, distopt=True),
    "tp2": dict(parallel=dict(tensor_model_parallel_size=2)),
    "tp2-sp": dict(parallel=dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": dict(parallel=dict(pipeline_model_parallel_size=2)),
    # Full recomputation: the first stage's frozen embedding output must still carry the graph.
    "pp2-recompute": dict(parallel=dict(pipeline_model_parallel_size=2, recompute=True)),
}
LAYOUTS_4 = {
    "tp2xpp2": dict(parallel=dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "tp2-sp-xpp2-distopt": dict(parallel=dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                              sequence_parallel=True), distopt=True),
}


def _peft_logits(base_hf: str, peft_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, peft_dir).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def export_checks() -> dict:
    """A LoRA checkpoint (saved at the current layout) exported merged and as PEFT adapters,
    compared in transformers / peft with the LoRA model's own logits; plus a PEFT directory
    whose k and v adapters are swapped (must not match)."""
    import dataclasses
    import os
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import (
        compare_logits, comparison_tokens, export_megatron_to_hf, hf_logits, megatron_logits,
    )
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.lora_export import export_merged, export_peft, lora_meta
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import save_checkpoint
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    arch = get_preset("tiny")
    cfg = LoRAConfig(**LORA)
    with tempfile.TemporaryDirectory() as tmp, model_parallel(par, seed=SEED):
        d = {name: os.path.join(tmp, name) for name in ("lora", "base", "base_hf", "merged", "peft", "swapped")}
        lora = setup_model(arch, par, seed=SEED, lora=cfg)
        perturb_adapters(lora)
        base = setup_model(arch, par, seed=SEED, trainable=False)
        from megatron_prune.model.lora_base import preset_base

        # The checkpoint holds the adapters alone; both exports regenerate the recorded preset base.
        # Recorded as trained with adapter dropout (it acts in training only): the PEFT config says so.
        trained = dataclasses.replace(cfg, dropout=0.1)
        save_checkpoint(d["lora"], iteration=1, model=lora, arch=arch,
                        extra_meta=lora_meta(trained, base=preset_base("tiny", seed=SEED).to_dict()))
        save_checkpoint(d["base"], iteration=1, model=base, arch=arch)
        export_megatron_to_hf(load_dir=d["base"], hf_out=d["base_hf"])
        export_merged(load_dir=d["lora"], hf_out=d["merged"])
        export_peft(load_dir=d["lora"], peft_out=d["peft"])
        shutil.copytree(d["peft"], d["swapped"])
        path = os.path.join(d["swapped"], "adapter_model.safetensors")
        tensors = load_file(path)
        k = "base_model.model.model.layers.0.self_attn.{}_proj.lora_B.weight"
        tensors[k.format("k")], tensors[k.format("v")] = tensors[k.format("v")], tensors[k.format("k")]
        save_file(tensors, path)
        tokens = comparison_tokens(vocab_size=arch.vocab_size, batch_size=2, seq_length=16, seed=5)
        megatron = megatron_logits(lora, tokens)
        # The usual start (--hf-model + --lora-rank): base weights from HF, then fresh adapters.
        from megatron_prune.training.session import load_hf_weights

        from_hf = setup_model(arch, par, seed=SEED + 9, lora=cfg,
                              load_base=lambda chunks: load_hf_weights(chunks, d["base_hf"], arch))
        v = arch.vocab_size  # HF holds no padded vocabulary rows
        from_hf_equal = torch.equal(megatron_logits(from_hf, tokens)[..., :v], megatron_logits(base, tokens)[..., :v])
        with open(os.path.join(d["peft"], "adapter_config.json")) as f:
            peft_config = __import__("json").load(f)
        return dict(
            merged=compare_logits(hf_logits(d["merged"], tokens), megatron),
            peft=compare_logits(_peft_logits(d["base_hf"], d["peft"], tokens), megatron),
            swapped=compare_logits(_peft_logits(d["base_hf"], d["swapped"], tokens), megatron),
            base=compare_logits(hf_logits(d["base_hf"], tokens), megatron),
            peft_keys=sorted(load_file(os.path.join(d["peft"], "adapter_model.safetensors"))),
            peft_config=peft_config,
            from_hf_equal=from_hf_equal,
        )


def grpo_kl_reference() -> dict:
    """One GRPO step (rollout with adapters on, KL > 0) of a LoRA policy with the adapter-off
    reference, and the same step with a separate frozen copy of the base as the reference."""
    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.trainer import build_objective, toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.lora import LoRAConfig, adapter_off
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    arch = get_preset("tiny")
    out = {}
    with model_parallel(par, seed=SEED):
        policy = setup_model(arch, par, seed=SEED, lora=LoRAConfig(**LORA))
        perturb_adapters(policy)
        references = {"adapter_off": adapter_off(policy),
                      "frozen_copy": setup_model(arch, par, seed=SEED, trainable=False)}
        for name, reference in references.items():
            configs = {
                "TrainConfig": TrainConfig(global_batch_size=4, micro_batch_size=4, seq_length=48, seed=SEED),
                "GRPOConfig": GRPOConfig(group_size=4, max_new_tokens=6, kl_beta=0.1),
                "DPPOArgs": DPPOArgs(completion_prune_rate=0.5, dense_packing=True),
            }
            source = toy_source(vocab_size=arch.vocab_size, num_prompts=16, seed=SEED)
            objective = build_objective(configs=configs, arch=arch, policy=policy, reference=reference, source=source)
            for chunk in policy:
                chunk.zero_grad_buffer()
            metrics = objective.train_step(0)
            items = [it for mb in objective.buffer.minibatches for it in mb]
            out[name] = dict(metrics=metrics, completions=[tuple(it.completion) for it in items],
                             ref=[it.ref_logprobs.clone() for it in items])
    return out


PRUNED_BRANCH_RUNS = {  # layout, pruned responses on the stored prompt K/V, pruned response joins the training row
    "own row, concat": ("concat", True, False),
    "own row, shared": ("shared", False, False),
    "in the training row": ("shared", False, True),
    "on the prompt's stored keys and values": ("shared", True, False),
}


def pruned_branch_dropout() -> dict:
    """A branch-pruned DPO step at adapter dropout 0.3, per way the pruned responses run: how many
    adapter inputs its policy forwards had and how many of them were dropped, and its counters."""
    from dataclasses import replace

    import megatron_prune.dpo.step as dpo_step
    from megatron_prune.model import lora as lora_module
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    inputs: list[bool] = []
    adapter_input, joins = lora_module._LoRAMixin._adapter_input, dpo_step.pruned_branch_joins_training_row

    def spied(self, x):
        out = adapter_input(self, x)
        inputs.append(out is not x)
        return out

    found = {}
    par = ParallelConfig()
    with model_parallel(par, seed=SEED):
        policy = setup_model(get_preset("tiny"), par, seed=SEED,
                             lora=lora_module.LoRAConfig(**{**LORA, "dropout": 0.3}))
        perturb_adapters(policy)
        lora_module._LoRAMixin._adapter_input = spied
        try:
            for name, (layout, on_prefix_kv, join) in PRUNED_BRANCH_RUNS.items():
                dpo_step.pruned_branch_joins_training_row = lambda plan, *, weights, join=join: join
                settings = replace(_settings(dict(branch=True, branch_chosen_prob=0.3), layout),
                                   pruned_branch_on_prefix_kv=on_prefix_kv)
                runner = dpo_step.DPOStep(settings=settings, policy=policy, reference=lora_module.adapter_off(policy))
                inputs.clear()
                _, counters = runner.run(0, _my_samples())
                found[name] = dict(inputs=len(inputs), dropped=sum(inputs), counters=counters)
                for chunk in policy:
                    chunk.zero_grad_buffer()
        finally:
            lora_module._LoRAMixin._adapter_input = adapter_input
            dpo_step.pruned_branch_joins_training_row = joins
    return found


def single_rank() -> dict:
    dropout = {**LORA, "dropout": 0.3}
    return dict(step=lora_step(), ref=reference_checks(), loss=fresh_dpo_loss(), frozen_step=lora_step(),
                export=export_checks(), grpo=grpo_kl_reference(), dropout=lora_step(lora=dropout),
                dropout_recompute=lora_step(parallel=dict(recompute=True), lora=dropout),
                pruned_dropout=pruned_branch_dropout())


def layouts(which: str) -> dict:
    table = LAYOUTS_2 if which == "2" else LAYOUTS_4
    out = {name: lora_step(**kw) for name, kw in table.items()}
    if which == "2":
        import tempfile

        box = [tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        path = box[0] + "/ckpt"
        out["saved:tp2-sp"] = lora_step(parallel=LAYOUTS_2["tp2-sp"]["parallel"], save_to=path)
        out["reloaded:pp2"] = reload(path=path, parallel=dict(pipeline_model_parallel_size=2))
        out["reloaded:dp2"] = reload(path=path, parallel={})
        out["saved_keys"] = saved_model_keys(path)
        path = box[0] + "/distopt"
        out["saved:dp2-distopt"] = lora_step(parallel={}, distopt=True, save_to=path)
        out["reloaded:tp2-distopt"] = reload(path=path, parallel=dict(tensor_model_parallel_size=2), distopt=True)
        out["ref:tp2-sp"] = reference_checks(parallel=LAYOUTS_2["tp2-sp"]["parallel"])
        for name in ("tp2", "tp2-sp"):
            out[f"dropout:{name}"] = lora_step(parallel=LAYOUTS_2[name]["parallel"], lora={**LORA, "dropout": 0.3})
    return out


@pytest.fixture(scope="module")
def single() -> dict:
    return run_distributed(single_rank, 1)[0]


def _assert_step_matches(ref: dict, got: dict, label: str) -> None:
    torch.testing.assert_close(got["metrics"]["loss"], ref["metrics"]["loss"], rtol=1e-5, atol=1e-7,
                               msg=f"{label}: loss")
    assert got["success"] and ref["success"]
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), label
    assert set(got["after"]) == set(ref["after"])
    for name in ("grads", "after") if got["grads"] is not None else ("after",):
        assert set(got[name]) == set(ref[name])
        for key, expected in ref[name].items():
            atol = max(1e-7, 1e-5 * float(expected.abs().max()))
            torch.testing.assert_close(got[name][key], expected, rtol=1e-5, atol=atol,
                                       msg=lambda m: f"{label}: {name} {key}: {m}")


def _assert_only_adapters_train(frozen: dict, label: str, *, distopt: bool = False) -> None:
    assert frozen["base_unchanged"], f"{label}: a base weight changed in the step"
    assert not frozen["base_requires_grad"], f"{label}: base weights require grad: {frozen['base_requires_grad'][:3]}"
    assert not frozen["base_main_grad"], f"{label}: base weights have grad buffers: {frozen['base_main_grad'][:3]}"
    assert frozen["buffered_non_adapters"] == 0 and frozen["buffered_adapters"] > 0, label
    # The optimizer holds exactly the adapters (sharded over DP with the distributed optimizer),
    # and Adam's two moments of exactly those elements.
    assert frozen["optimizer_numel"] == frozen["adapter_numel"], label
    assert frozen["state_numel"] == 2 * frozen["local_optimizer_numel"], label


@pytest.mark.distributed
def test_fresh_adapter_is_the_base_model(single):
    ref = single["ref"]
    assert torch.equal(ref["fresh_logits"], ref["base_logits"])
    assert not torch.allclose(ref["tuned_logits"], ref["base_logits"], atol=1e-4), "adapters changed nothing"
    assert single["loss"]["lora"]["loss"] == single["loss"]["base"]["loss"]
    assert single["loss"]["lora"]["margin"] == single["loss"]["base"]["margin"]


def _fresh_adapter_weights() -> dict:
    """Every adapter matrix of a fresh rank-4 LoRA model (one rank: whole matrices), by name."""
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    with model_parallel(par, seed=SEED):
        policy = setup_model(get_preset("tiny"), par, seed=SEED, lora=LoRAConfig(**LORA))
        return {name: p.detach().clone() for chunk in policy for name, p in chunk.named_parameters()
                if "lora_" in name}


@pytest.mark.distributed
def test_fresh_adapters_start_at_b_zero_and_a_uniform_over_the_input_width():
    """B = 0; A ~ U(-1/sqrt(in), 1/sqrt(in)) with its own draw in every layer and linear (the
    bound comes from the input width, not the rank)."""
    weights = run_distributed(_fresh_adapter_weights, 1)[0]
    a_matrices = {name: w for name, w in weights.items() if name.endswith("lora_A")}
    b_matrices = {name: w for name, w in weights.items() if name.endswith("lora_B")}
    assert len(a_matrices) == len(b_matrices) >= 8
    assert all(not w.any() for w in b_matrices.values())
    for name, w in a_matrices.items():
        rank, width = w.shape
        assert rank == LORA["rank"], name
        bound = 1.0 / width ** 0.5
        assert 0.9 * bound < float(w.abs().max()) <= bound, (name, float(w.abs().max()), bound)
    by_linear: dict[str, list[torch.Tensor]] = {}
    for name, w in a_matrices.items():
        linear = name.split(".layers.")[1].split(".", 1)[1]  # the same linear in every layer
        by_linear.setdefault(linear, []).append(w)
    for linear, layers in by_linear.items():
        assert len(layers) >= 2, linear
        assert all(not torch.equal(layers[0], other) for other in layers[1:]), f"{linear}: the same A in two layers"


@pytest.mark.distributed
def test_adapter_off_reference_is_the_frozen_base(single):
    ref = single["ref"]
    off, frozen, on = ref["logps"]["adapter_off"], ref["logps"]["frozen_copy"], ref["logps"]["adapters_on"]
    assert off.keys() == frozen.keys() and len(off) > 0
    for key in off:
        torch.testing.assert_close(off[key], frozen[key], rtol=0, atol=1e-6)
    assert max((on[k] - frozen[k]).abs().max().item() for k in off) > 1e-4, "the adapters changed no log-prob"
    torch.testing.assert_close(ref["after_logits"], ref["tuned_logits"], rtol=0, atol=0)
    dropped = ref["logps"]["dropout_no_grad"]
    assert dropped.keys() == on.keys() and all(torch.equal(dropped[k], on[k]) for k in on), \
        "adapter dropout acted in a forward-only pass"


@pytest.mark.distributed
def test_grpo_kl_reference_is_the_adapter_off_policy(single):
    off, frozen = single["grpo"]["adapter_off"], single["grpo"]["frozen_copy"]
    assert off["completions"] == frozen["completions"] and off["completions"]
    for a, b in zip(off["ref"], frozen["ref"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert off["metrics"]["kl"] == pytest.approx(frozen["metrics"]["kl"], rel=1e-5)
    assert off["metrics"]["kl"] > 0, "the adapters moved the policy: the KL to the base must be positive"


@pytest.mark.distributed
def test_only_adapters_train_single_rank(single):
    _assert_only_adapters_train(single["step"]["frozen"], "single rank")
    norm = sum(float(g.double().pow(2).sum()) for g in single["step"]["grads"].values()) ** 0.5
    assert single["step"]["grad_norm"] == pytest.approx(norm, rel=1e-6)
    assert all(float(g.abs().max()) > 0 for g in single["step"]["grads"].values()), "an adapter got no gradient"
    # Deterministic: the same step twice gives the same result bit for bit.
    assert single["frozen_step"]["metrics"] == single["step"]["metrics"]


def test_adapter_dropout_under_full_recompute_is_the_same_step(single):
    """Full recompute runs each layer's first forward without gradients and recomputes it in
    backward: adapter dropout must act in both, with the same masks, so the loss and the gradients
    come from one dropped model, the one a run without recompute trains."""
    plain, recomputed = single["dropout"], single["dropout_recompute"]
    assert plain["metrics"]["loss"] != single["step"]["metrics"]["loss"], "dropout changed nothing"
    assert recomputed["metrics"]["loss"] == plain["metrics"]["loss"]
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(recomputed["grads"][name], grad, rtol=1e-6, atol=1e-8, msg=name)


def test_adapter_dropout_acts_on_pruned_responses_however_they_run(single):
    """Branch pruning's pruned responses stand in for what the full step's training pass scores
    under dropout: every adapter input of every policy forward of the step is dropped, whether
    the pruned responses run as their own forward-only rows, inside the training row, or on the
    training row's stored prompt keys and values (the reference, adapters off, has none)."""
    runs = single["pruned_dropout"]
    assert set(runs) == set(PRUNED_BRANCH_RUNS)
    for name, run in runs.items():
        assert run["inputs"] > 0 and run["dropped"] == run["inputs"], f"{name}: {run}"
    shared = [name for name, (layout, *_) in PRUNED_BRANCH_RUNS.items() if layout == "shared"]
    passes = {(runs[n]["counters"]["train_tokens"], runs[n]["counters"]["forward_only_tokens"]) for n in shared}
    assert len(passes) == len(shared), f"the shared layout's three ways ran the same passes: {passes}"


@pytest.mark.distributed
def test_lora_step_layouts_match_single_rank_2_ranks(single):
    per_rank = run_distributed(layouts, 2, which="2")
    results = per_rank[0]
    assert set(LAYOUTS_2) <= set(results)
    for rank, name, got in every_rank(per_rank):
        if name in LAYOUTS_2:
            _assert_step_matches(single["step"], got, f"rank {rank}: {name}")
            _assert_only_adapters_train(got["frozen"], f"rank {rank}: {name}")
    for name in ("tp2", "tp2-sp"):
        assert results[name]["replicas_agree"], name
        got = results[f"dropout:{name}"]
        assert got["replicas_agree"], f"dropout under {name}: replicated adapters diverged over TP"
        assert got["metrics"]["loss"] != pytest.approx(results[name]["metrics"]["loss"], rel=1e-9, abs=0), \
            "dropout changed nothing"
    # A checkpoint saved at TP=2+SP (adapters and their optimizer state) loads at PP=2 and at DP=2,
    # one saved with the distributed optimizer at DP=2 loads at TP=2: the same adapters, and on the
    # base rebuilt from the recorded preset the same logits as the saved model.
    for saved_as, reloaded in (("saved:tp2-sp", ("reloaded:pp2", "reloaded:dp2")),
                               ("saved:dp2-distopt", ("reloaded:tp2-distopt",))):
        saved = results[saved_as]
        for name in reloaded:
            assert set(results[name]["after"]) == set(saved["after"]) and results[name]["lora"]["rank"] == LORA["rank"]
            for key, value in saved["after"].items():
                assert torch.equal(results[name]["after"][key], value), f"{name}: {key}"
            torch.testing.assert_close(results[name]["logits"], saved["logits"], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
    # The checkpoint holds the adapters alone, no base weight.
    keys = results["saved_keys"]
    assert keys and all(_is_adapter(k) for k in keys), [k for k in keys if not _is_adapter(k)][:3]
    assert len(keys) == 2 * 4, keys  # A and B of the four targeted linears (layers stacked per key)
    ref = results["ref:tp2-sp"]
    assert torch.equal(ref["fresh_logits"], ref["base_logits"])
    torch.testing.assert_close(ref["tuned_logits"], single["ref"]["tuned_logits"], rtol=1e-5, atol=1e-5)
    for key, values in ref["logps"]["adapter_off"].items():
        torch.testing.assert_close(values, ref["logps"]["frozen_copy"][key], rtol=0, atol=1e-6)


@pytest.mark.slow  # four gloo ranks on a small CPU machine: ~2 min
@pytest.mark.distributed
def test_lora_step_layouts_match_single_rank_4_ranks(single):
    results = run_distributed(layouts, 4, which="4")[0]
    for name in LAYOUTS_4:
        _assert_step_matches(single["step"], results[name], name)
        _assert_only_adapters_train(results[name]["frozen"], name)


DPO_LAYOUTS = {"full": dict(layout="full"), "shared": dict(layout="shared"),
               "concat, packed rows": dict(layout="concat", pack_rows=True),
               "shared, packed rows": dict(layout="shared", pack_rows=True)}
PRUNINGS = {"none": {}, "position+sequence": dict(position_ratio=0.6, seq_min_ratio=0.5),
            "all": dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True, branch_chosen_prob=0.3)}


def dpo_layouts_under_lora() -> dict:
    """The LoRA step (adapter-off reference) in concat and in every other DPO layout, per pruning."""
    return {prune: {"concat": lora_step(prune=kw), **{name: lora_step(prune=kw, **layout)
                                                       for name, layout in DPO_LAYOUTS.items()}}
            for prune, kw in PRUNINGS.items()}


@pytest.mark.distributed
def test_lora_step_is_the_same_in_every_dpo_layout():
    """Under LoRA too, the full and shared layouts and packed rows are the concat step (loss,
    every adapter gradient, adapters after the step) with and without pruning. The shared
    layout runs pruned responses on stored prompt keys and values: adapters on, no backward."""
    res = run_distributed(dpo_layouts_under_lora, 1)[0]
    for prune, by_layout in res.items():
        for name, got in by_layout.items():
            _assert_step_matches(by_layout["concat"], got, f"{name}, pruning {prune}")
            _assert_only_adapters_train(got["frozen"], f"{name}, pruning {prune}")
    # The prunings change the step (position and sequence pruning the loss, branch pruning the
    # gradient), so the comparisons above are not all between the same step.
    none, pos_seq, all_ = (res[p]["concat"] for p in PRUNINGS)
    assert abs(float(none["metrics"]["loss"]) - float(pos_seq["metrics"]["loss"])) > 1e-4
    assert any(not torch.allclose(all_["grads"][k], pos_seq["grads"][k], rtol=1e-3, atol=1e-6) for k in all_["grads"])


GRPO_LORA = dict(dppo=dict(completion_prune_rate=0.5, dense_packing=True), kl_beta=0.1, lora=LORA)


def grpo_under_lora(which: str) -> dict:
    """One GRPO step of a LoRA policy (rollout with adapters on, DPPO completion pruning, dense
    packing, KL to the adapter-off policy): without and with a shared prompt at one rank, and
    with it at DP=2, TP=2 and PP=2."""
    from tests.distributed.test_grpo import grpo_step

    shared = {**GRPO_LORA, "dppo": {**GRPO_LORA["dppo"], "shared_prompt": True}}
    if which == "1":
        return {"plain": grpo_step(**GRPO_LORA), "shared": grpo_step(**shared)}
    return {name: grpo_step(parallel=par, **shared) for name, par in (
        ("dp2", {}), ("tp2", dict(tensor_model_parallel_size=2)), ("pp2", dict(pipeline_model_parallel_size=2)))}


@pytest.mark.distributed
def test_grpo_under_lora_is_layout_independent_and_shares_prompts_exactly():
    from tests.distributed.test_grpo import assert_same

    metrics = ("loss", "policy_loss", "kl_loss", "kl", "reward_mean", "kept_completion_fraction")
    single_rank = run_distributed(grpo_under_lora, 1, which="1")[0]
    plain, shared = single_rank["plain"], single_rank["shared"]
    assert plain["metrics"]["kl"] > 0 and plain["metrics"]["kept_completion_fraction"] < 1.0
    adapters = {k: g for k, g in plain["grads"].items() if _is_adapter(k)}
    assert adapters and all(float(g.abs().max()) > 0 for g in adapters.values()), "an adapter got no gradient"
    assert all(float(g.abs().max()) == 0 for k, g in plain["grads"].items() if not _is_adapter(k))
    assert_same(plain, shared, "shared prompt vs not", metrics=metrics)
    assert shared["metrics"]["train_tokens"] < plain["metrics"]["train_tokens"]
    for rank, name, got in every_rank(run_distributed(grpo_under_lora, 2, which="2")):
        assert_same(plain, got, f"rank {rank}: {name}", metrics=metrics)


ENUM_PAIRS = 4


def branch_enumeration_lora(q_w: float) -> dict:
    """Σ over every kept-branch pattern of P(pattern) · adapter grad(pattern), and the unpruned grad."""
    import itertools

    import tests.distributed.dpo_harness as h

    h.NUM_PAIRS = ENUM_PAIRS
    h.sample_pairs.cache_clear()
    prune = dict(position_ratio=0.6, seq_min_ratio=0.5)
    full = lora_step(prune=prune)
    expected: dict[str, torch.Tensor] = {}
    total = 0.0
    for pattern in itertools.product((0, 1), repeat=ENUM_PAIRS):
        prob = 1.0
        for kept in pattern:
            prob *= q_w if kept == 0 else 1.0 - q_w
        got = lora_step(prune={**prune, "branch": True, "branch_chosen_prob": q_w}, branch_pattern=pattern)
        for key, grad in got["grads"].items():
            expected[key] = expected.get(key, 0.0) + prob * grad.double()
        total += prob
    return dict(full=full["grads"], expectation=expected, total=total)


@pytest.mark.distributed
def test_branch_pruning_is_unbiased_under_lora():
    res = run_distributed(branch_enumeration_lora, 1, q_w=0.3)[0]
    assert abs(res["total"] - 1.0) < 1e-12
    assert res["full"] and set(res["expectation"]) == set(res["full"])
    for key, grad in res["full"].items():
        assert float(grad.abs().max()) > 0
        torch.testing.assert_close(res["expectation"][key].float(), grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda m: f"E[branch-pruned adapter grad] != full grad for {key}: {m}")


@pytest.mark.distributed
def test_merged_and_peft_exports_match_the_lora_model(single):
    res = single["export"]  # peft is part of the [test] extra: the module fixture has loaded the PEFT directory
    assert res["from_hf_equal"], "a fresh LoRA model on HF base weights is not the base model"
    assert res["merged"].max_abs_diff <= EXPORT_TOLERANCE, res["merged"].summary()
    assert res["peft"].max_abs_diff <= EXPORT_TOLERANCE, res["peft"].summary()
    # Negative controls: the adapters matter, and swapped k/v adapters are caught.
    assert res["base"].max_abs_diff > 100 * EXPORT_TOLERANCE
    assert res["swapped"].max_abs_diff > 100 * EXPORT_TOLERANCE
    layer0 = [k for k in res["peft_keys"] if ".layers.0." in k]
    assert len(layer0) == 2 * 7 and "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight" in layer0
    assert res["peft_config"]["r"] == LORA["rank"] and res["peft_config"]["lora_alpha"] == LORA["alpha"]
    assert res["peft_config"]["lora_dropout"] == 0.1
    assert sorted(res["peft_config"]["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
