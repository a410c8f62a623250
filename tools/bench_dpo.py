"""DPO pruning modes side by side: step time, peak memory and tokens, against the FLOP model.

Every mode runs in a fresh process (``torchrun --nproc-per-node TP*PP`` when TP*PP > 1) on the
same model and the same preference pairs: a few warm-up steps, then timed steps of the DPO step
(reference forward, pruned-branch forward, policy forward-backward) plus the optimizer step.

Modes (all ratios are against ``concat``):

=================  =======  =========  ==========================================
mode               layout   head       pruning
=================  =======  =========  ==========================================
full               full     all rows   none (Full: chosen/rejected as padded rows)
concat             concat   all rows   none (Full-concat)
selective          concat   selective  none
position           concat   selective  position, alpha = 0.6
sequence           concat   selective  sequence, rho_min = 0.5
branch             concat   selective  branch, q_w = 0.5
position_branch    concat   selective  position + branch
all                concat   selective  position + sequence + branch
shared             shared   selective  none (one row [prompt, chosen, rejected] per pair)
shared_all         shared   selective  position + sequence + branch
shared_packed      shared   selective  none; each microbatch's rows in one row
shared_all_packed  shared   selective  position + sequence + branch; packed rows
concat_packed      concat   all rows   none; packed rows (Full-concat without padding)
branch_packed      concat   selective  branch; packed rows
=================  =======  =========  ==========================================

Packed rows (``--dpo-pack-rows``) remove the padding between pairs, which the FLOP ideal does not
count: ``branch_packed`` against ``concat_packed`` is branch pruning's speedup with neither side
paying for padding (both against ``concat`` are in the table).

Timed steps run first and touch no memory statistics. Then the first ``--memory-steps`` timed
steps are replayed (same pruning draws) with a peak window around each phase (reference,
pruned branch, training pass, optimizer); the step's peak is the largest. Peak memory is the
step's own: on CPU the peak RSS (VmHWM, reset through /proc/self/clear_refs) above the RSS before
the step, with the heap trimmed before each window and large allocations mmapped so RSS follows
live tensors; on GPU the allocator peak above the memory allocated before the step (weights,
gradients and optimizer state are in that baseline after warm-up). One more replay under
torch.profiler gives the tensor-allocator peak on either device and what is live at it
(``peak_alloc_bytes``, ``live_at_peak``).

With ``--lora-rank R`` every mode trains LoRA adapters of rank R on every linear (frozen base)
against the adapter-off reference (no second model); speedups are held against the LoRA FLOP
model (``flop_model.step_flops(lora_rank=R)``), and one more run of full-parameter ``concat`` with
an online reference gives the memory to compare with: ``state_mem_bytes`` counts the persistent
tensors (weights, reference copy, gradient buffers, optimizer state) and ``total_mem_bytes`` adds
the step's peak; ``total_mem_ratio_vs_full_param`` = a mode's total / full-parameter concat's
(``total_alloc_mem_ratio_vs_full_param``: the same with the tensor-allocator peaks, which count
live tensors only, not what the process holds beyond them; ``model_total_mem_ratio_vs_full_param``:
from ``flop_model.state_bytes`` and ``flop_model.step_peak_bytes``).

Lengths come from the bundled HH-RLHF sample tokenized with the tiny tokenizer (or
``--data-path``); token ids are mapped into the model's vocabulary.

    python tools/bench_dpo.py --preset cpu-small --json /tmp/bench.json --plot /tmp/bench.png
    python tools/bench_dpo.py --preset cpu-small --modes concat branch --steps 3
    python tools/bench_dpo.py --preset cpu-moe-small --json /tmp/bench-moe.json
    python tools/bench_dpo.py --preset gpu-qwen3-0.6b --json out/qwen3-0.6b.json
    python tools/bench_dpo.py --preset cpu-small --tensor-model-parallel-size 2
    python tools/bench_dpo.py --preset cpu-small --lora-rank 64 --json /tmp/bench-lora.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flop_model  # noqa: E402
from memory_at_peak import format_live_at_peak, live_at_peak  # noqa: E402

MODES: dict[str, dict] = {
    "full": dict(layout="full", selective_head=False, position_ratio=1.0, seq_min_ratio=1.0, branch=False),
    "concat": dict(layout="concat", selective_head=False, position_ratio=1.0, seq_min_ratio=1.0, branch=False),
    "selective": dict(layout="concat", selective_head=True, position_ratio=1.0, seq_min_ratio=1.0, branch=False),
    "position": dict(layout="concat", selective_head=True, position_ratio=0.6, seq_min_ratio=1.0, branch=False),
    "sequence": dict(layout="concat", selective_head=True, position_ratio=1.0, seq_min_ratio=0.5, branch=False),
    "branch": dict(layout="concat", selective_head=True, position_ratio=1.0, seq_min_ratio=1.0, branch=True),
    "position_branch": dict(layout="concat", selective_head=True, position_ratio=0.6, seq_min_ratio=1.0, branch=True),
    "all": dict(layout="concat", selective_head=True, position_ratio=0.6, seq_min_ratio=0.5, branch=True),
    "shared": dict(layout="shared", selective_head=True, position_ratio=1.0, seq_min_ratio=1.0, branch=False),
    "shared_all": dict(layout="shared", selective_head=True, position_ratio=0.6, seq_min_ratio=0.5, branch=True),
    "shared_packed": dict(layout="shared", selective_head=True, position_ratio=1.0, seq_min_ratio=1.0, branch=False,
                          pack_rows=True),
    "shared_all_packed": dict(layout="shared", selective_head=True, position_ratio=0.6, seq_min_ratio=0.5,
                              branch=True, pack_rows=True),
    "concat_packed": dict(layout="concat", selective_head=False, position_ratio=1.0, seq_min_ratio=1.0, branch=False,
                          pack_rows=True),
    "branch_packed": dict(layout="concat", selective_head=True, position_ratio=1.0, seq_min_ratio=1.0, branch=True,
                          pack_rows=True),
}

_QWEN3 = dict(model_type="qwen3", qk_norm=True, rope_theta=1000000.0, max_position_embeddings=4096)
_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

PRESETS: dict[str, dict] = {
    # Head share of forward FLOPs ~10% at 512 tokens (Qwen3-4B: 9.5%); a step takes seconds on 2 cores.
    "cpu-small": dict(
        arch=dict(_QWEN3, vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        pairs=4, micro_batch_size=2, max_seq_length=256, max_prompt_length=160, warmup=1, steps=8,
        device="cpu", bf16=False),
    # Same body, a 32k vocabulary: the head dominates output memory.
    "cpu-head-heavy": dict(
        arch=dict(_QWEN3, vocab_size=32768, hidden_size=256, intermediate_size=1024, num_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        pairs=4, micro_batch_size=2, max_seq_length=384, max_prompt_length=192, warmup=1, steps=6,
        device="cpu", bf16=False),
    # cpu-small's attention and vocabulary with a Qwen3-MoE MLP in every layer: 8 experts of width
    # 256, top-2 (Qwen3-30B-A3B routes 8 of 128), so a token runs half of cpu-small's dense MLP width.
    "cpu-moe-small": dict(
        arch=dict(_QWEN3_MOE, vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=256),
        pairs=4, micro_batch_size=2, max_seq_length=256, max_prompt_length=160, warmup=1, steps=6,
        device="cpu", bf16=False),
    # Qwen3-0.6B's shape (tied embeddings), random weights.
    "gpu-qwen3-0.6b": dict(
        arch=dict(_QWEN3, vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
        pairs=32, micro_batch_size=4, max_seq_length=1024, max_prompt_length=512, warmup=2, steps=5,
        device="cuda", bf16=True),
    # Qwen3-4B's widths with 8 of its 36 layers.
    "gpu-qwen3-4b-slice": dict(
        arch=dict(_QWEN3, vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=8,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
        pairs=32, micro_batch_size=4, max_seq_length=1024, max_prompt_length=512, warmup=2, steps=4,
        device="cuda", bf16=True),
    # Qwen3-30B-A3B's widths (128 experts of width 768, top-8, hidden 2048, untied 151k vocabulary)
    # with 6 of its 48 layers, all experts on one GPU (EP=1): ~4.4B parameters, ~87 GB of bf16
    # weights, fp32 gradients, fp32 main weights, Adam state and the bf16 reference on one H200.
    "gpu-qwen3-30b-a3b-slice": dict(
        arch=dict(_QWEN3_MOE, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=6,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False),
        pairs=16, micro_batch_size=2, max_seq_length=1024, max_prompt_length=512, warmup=1, steps=3,
        device="cuda", bf16=True),
}

SEED = 1234


def _preset_help() -> str:
    def one(name: str, p: dict) -> str:
        a = p["arch"]
        moe = f", {a['num_experts']} experts top-{a['num_experts_per_tok']}" if a.get("num_experts") else ""
        return (f"{name} (hidden {a['hidden_size']}, {a['num_layers']} layers, vocabulary {a['vocab_size']}{moe}; "
                f"{p['pairs']} pairs per step in microbatches of {p['micro_batch_size']}, rows <= "
                f"{p['max_seq_length']} tokens; {p['device']})")

    return "; ".join(one(name, preset) for name, preset in PRESETS.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_prune.arguments import (ToolHelpFormatter, above, at_least, refuse_bad_data_files,
                                          refuse_plot_without_matplotlib,
                                          refuse_unrunnable_layout, refuse_unwritable_outputs)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default="cpu-small",
                   help="model shape, data lengths and batch: " + _preset_help())
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES),
                   help="modes to run, in this order (concat is always added and runs first: ratios are against it)")
    p.add_argument("--data-path", nargs="+", default=None, help="preference files (default: bundled HH-RLHF sample)")
    p.add_argument("--pairs", type=at_least(1), help="pairs per step (default: preset)")
    p.add_argument("--micro-batch-size", type=at_least(1), help="pairs per microbatch (default: preset)")
    p.add_argument("--max-seq-length", type=at_least(2), help="longest prompt+response (default: preset)")
    p.add_argument("--max-prompt-length", type=at_least(1),
                   help="longest prompt kept (default: the preset's, at most 5/8 of --max-seq-length)")
    p.add_argument("--warmup", type=at_least(0), help="untimed steps (default: preset)")
    p.add_argument("--steps", type=at_least(1), help="timed steps (default: preset)")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="run every mode this many times, interleaved, pooling the steps (noisy machines)")
    p.add_argument("--memory-steps", type=at_least(1), default=3,
                   help="timed steps replayed (same pruning draws) to measure peak memory (default: 3)")
    p.add_argument("--recompute-activations", action="store_true", help="full activation recompute")
    p.add_argument("--skip-invalid-records", action="store_true",
                   help="skip (count and log) records that are malformed or unusable at --max-seq-length, e.g. "
                        "responses identical after truncation, instead of stopping at the first one")
    p.add_argument("--lora-rank", type=at_least(0), default=0,
                   help="train LoRA adapters of this rank (alpha = rank) on every linear, adapter-off reference; "
                        "0 = full-parameter training with an online reference")
    p.add_argument("--tensor-model-parallel-size", type=at_least(1), default=1,
                   help="TP of every mode's run (above 1 the tool starts torchrun itself)")
    p.add_argument("--pipeline-model-parallel-size", type=at_least(1), default=1,
                   help="PP of every mode's run (above 1 the tool starts torchrun itself)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="default: preset")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rewritten after every mode)")
    p.add_argument("--plot", metavar="PATH", help="PNG bar chart of speedup and memory ratio vs the model")
    p.add_argument("--profile", metavar="DIR", help="also write a torch.profiler table of one step per mode")
    p.add_argument("--timeout", type=above(0), default=900.0, help="seconds per mode before it is killed")
    p.add_argument("--worker", choices=tuple(MODES), help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    refuse_bad_data_files(p, "--data-path", args.data_path)
    preset = PRESETS[args.preset]
    for key in ("pairs", "micro_batch_size", "max_seq_length", "warmup", "steps", "device"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.max_prompt_length is None:
        args.max_prompt_length = min(preset["max_prompt_length"], args.max_seq_length * 5 // 8)
    if not 1 <= args.max_prompt_length < args.max_seq_length:
        p.error(f"--max-prompt-length ({args.max_prompt_length}) must be in [1, --max-seq-length "
                f"({args.max_seq_length}))")
    if args.pairs % args.micro_batch_size:
        p.error(f"--pairs ({args.pairs}) must be a multiple of --micro-batch-size ({args.micro_batch_size})")
    refuse_plot_without_matplotlib(p, args.plot)
    refuse_unwritable_outputs(p, json=args.json, plot=args.plot, profile_dir=args.profile)
    refuse_unrunnable_layout(p, build_arch(args), tp=args.tensor_model_parallel_size,
                             pp=args.pipeline_model_parallel_size)
    if "concat" not in args.modes:
        args.modes = ["concat"] + list(args.modes)
    return args


def build_arch(args):
    from megatron_prune.model.arch import ModelArch

    return ModelArch(**PRESETS[args.preset]["arch"])


def load_pairs(args, vocab_size: int):
    """``args.pairs`` pairs drawn (seeded) from the data; ids mapped into ``vocab_size``."""
    import random

    from megatron_prune.data import HH_RLHF_SAMPLE
    from megatron_prune.data.preference import PreferenceDataConfig, PreferenceDataset
    from megatron_prune.data.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    ds = PreferenceDataset(args.data_path or [HH_RLHF_SAMPLE], tokenizer=tok,
                           config=PreferenceDataConfig(max_seq_length=args.max_seq_length,
                                                       max_prompt_length=args.max_prompt_length,
                                                       skip_invalid=args.skip_invalid_records))
    if len(ds) < args.pairs:
        raise SystemExit(f"bench_dpo.py: the data has {len(ds)} usable pairs at --max-seq-length "
                         f"{args.max_seq_length}, fewer than --pairs {args.pairs}")
    ids = random.Random(SEED).sample(range(len(ds)), args.pairs)

    def remap(seq):  # spread the tiny tokenizer's ids over the model vocabulary; keep pad fixed
        return [t if t == tok.pad_id else (t * 7919) % vocab_size or 1 for t in seq]

    out = []
    for i in ids:
        pr = ds[i]
        out.append((i, dataclasses.replace(pr, prompt_ids=remap(pr.prompt_ids), chosen_ids=remap(pr.chosen_ids),
                                           rejected_ids=remap(pr.rejected_ids))))
    return out, tok.pad_id


def check_pairs(args) -> None:
    """Load the pairs once before any worker starts, so bad data stops the tool in one line."""
    from megatron_prune.data.records import DataError

    try:
        load_pairs(args, build_arch(args).vocab_size)
    except DataError as err:
        hint = "" if args.skip_invalid_records else "; pass --skip-invalid-records to skip such records"
        raise SystemExit(f"bench_dpo.py: {err}{hint}") from None


# --------------------------------------------------------------------------------------- worker
def run_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state

    import megatron_prune.dpo.step as step_mod
    from megatron_prune.accelerator import get_accelerator, set_accelerator
    from megatron_prune.config import DPOConfig, PruneConfig
    from megatron_prune.dpo.batch import row_length
    from megatron_prune.dpo.step import DPOStep, DPOStepSettings
    from megatron_prune.model.provider import ParallelConfig, padded_vocab_size
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import initialize_distributed, is_logging_rank, model_parallel

    mode = MODES[args.worker]
    set_accelerator(args.device)
    acc = get_accelerator()
    initialize_distributed()
    arch = build_arch(args)
    samples, pad_id = load_pairs(args, arch.vocab_size)
    tp = args.tensor_model_parallel_size
    par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                         sequence_parallel=tp > 1 and arch.is_moe,  # Megatron's MoE at TP > 1 needs it
                         bf16=PRESETS[args.preset]["bf16"], recompute=args.recompute_activations)
    with model_parallel(par, seed=SEED):
        if args.lora_rank:
            from megatron_prune.model.lora import LoRAConfig, adapter_off

            policy = setup_model(arch, par, seed=SEED, lora=LoRAConfig(rank=args.lora_rank))
            reference = adapter_off(policy)
        else:
            policy = setup_model(arch, par, seed=SEED)
            reference = setup_model(arch, par, seed=SEED, trainable=False)
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam", lr=1e-6), bf16=par.bf16)
        prune = PruneConfig(position_ratio=mode["position_ratio"], seq_min_ratio=mode["seq_min_ratio"],
                            branch=mode["branch"], selective_head=mode["selective_head"])
        settings = DPOStepSettings(dpo=DPOConfig(layout=mode["layout"], pack_rows=mode.get("pack_rows", False)),
                                   prune=prune, seed=SEED,
                                   micro_batch_size=args.micro_batch_size, pad_id=pad_id)
        runner = DPOStep(settings=settings, policy=policy, reference=reference)

        # Record the shapes of every pass (for the FLOP model) and time every schedule call.
        passes: list[dict] = []
        original_mb = runner._microbatches

        def recording_microbatches(plans, branches_of, **kw):
            batches, seq_length, groups = original_mb(plans, branches_of, **kw)
            mbs = []
            for g, b in zip(groups, batches):
                if mode["layout"] != "full":  # segment attention: segments (and prefixes) as they run
                    mbs.append(segment_shapes(b, b.tokens.shape[1]))
                else:  # one dense causal row per sequence
                    rows = [[len(p.prompt) + len(p.responses[br])] for p in g for br in branches_of(p)]
                    mbs.append(dict(rows=rows, seq_length=b.tokens.shape[1], scored=int(len(b.selection.index)),
                                    selective=mode["selective_head"]))
                assert row_length(g, layout=mode["layout"], branches=[branches_of(p) for p in g]) <= seq_length
            passes.append({"kind": "forward", "microbatches": mbs})
            return batches, seq_length, groups

        def segment_shapes(batch, seq_length: int) -> dict:
            """A microbatch as the FLOP model sees it: segment lengths and prefix keys per row."""
            rows = batch.segments.rows
            return dict(rows=[[s.length for s in row] for row in rows],
                        prefixes=[[s.prefix_length for s in row] for row in rows],
                        seq_length=seq_length, scored=int(len(batch.selection.index)),
                        selective=mode["selective_head"])

        runner._microbatches = recording_microbatches
        original_replays = runner._prefix_replays

        def recording_replays(batches, groups):
            # Pruned responses on the training pass's prompt keys and values: a forward-only pass
            # inside the training schedule (recorded before it: the last pass must be the training one).
            replays = original_replays(batches, groups)
            shapes = [segment_shapes(r, r.tokens.shape[1]) for r in replays]
            passes.insert(len(passes) - 1, {"kind": "forward", "microbatches": shapes})
            return replays

        runner._prefix_replays = recording_replays
        schedule_times: list[tuple[str, float]] = []
        phase_peaks: list[int] = []
        memory_window = {"on": False, "base": 0}
        original_schedule = step_mod.run_schedule

        def open_window() -> None:
            acc.synchronize()
            acc.release_cached_memory()
            acc.reset_peak_memory()

        def close_window() -> None:
            acc.synchronize()
            phase_peaks.append(max(0, acc.peak_memory_bytes() - memory_window["base"]))

        def timed_schedule(**kw):
            if memory_window["on"]:
                open_window()
            acc.synchronize()
            t = time.perf_counter()
            # Under the shared layout a step may have no pruned-branch pass (every pruned branch
            # ran inside its training row), so each call is named by what it is.
            label = "train" if not kw.get("forward_only") else ("pruned_branch" if schedule_times else "reference")
            with torch.profiler.record_function(f"phase:{label}"):
                out = original_schedule(**kw)
            acc.synchronize()
            schedule_times.append((label, time.perf_counter() - t))
            if memory_window["on"]:
                close_window()
            return out

        step_mod.run_schedule = timed_schedule
        phases = ["reference"] + (["pruned_branch"] if mode["branch"] else []) + ["train"]

        def one_step(step: int, *, measure_memory: bool, profile: bool = False, allocations: bool = False) -> dict:
            """Run one step. Timed steps touch no memory statistics (no trims, so no extra page
            faults); memory steps trim the heap and open a peak window around every phase;
            ``allocations`` also records every tensor allocation (profiler) for the allocator peak."""
            passes.clear()
            schedule_times.clear()
            phase_peaks.clear()
            memory_window["on"] = measure_memory
            prof = None
            if allocations or profile:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                              + ([torch.profiler.ProfilerActivity.CUDA] if acc.kind == "cuda" else []),
                                              profile_memory=True)
                prof.__enter__()
            if measure_memory:
                open_window()
                memory_window["base"] = acc.current_memory_bytes()
            acc.synchronize()
            t0 = time.perf_counter()
            for chunk in policy:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            _, counters = runner.run(step, samples)
            if measure_memory:
                open_window()
            acc.synchronize()
            t_opt = time.perf_counter()
            with torch.profiler.record_function("phase:optimizer"):
                optimizer.step()
            acc.synchronize()
            t1 = time.perf_counter()
            if measure_memory:
                close_window()
            alloc = None
            if prof is not None:
                prof.__exit__(None, None, None)
            if allocations:
                try:  # the figures above do not depend on it: a profiler this stack lacks skips it
                    alloc = live_at_peak(prof, acc.device.type)
                except Exception as exc:  # noqa: BLE001
                    print(f"[bench_dpo] {args.worker}: no allocator peak ({type(exc).__name__}: {exc})", flush=True)
            if profile:
                os.makedirs(args.profile, exist_ok=True)
                if is_logging_rank():
                    key = "self_cuda_time_total" if acc.kind == "cuda" else "self_cpu_time_total"
                    with open(os.path.join(args.profile, f"{args.worker}.txt"), "w") as f:
                        f.write(f"# one step of {args.worker}, by self time\n")
                        f.write(prof.key_averages().table(sort_by=key, row_limit=25))
                        f.write("\n# the same step's memory peak (rank 0), by phase, direction and op\n")
                        f.write(format_live_at_peak(*live_at_peak(prof, acc.device.type)) + "\n")
            # the last call of _microbatches is the training pass; the first is the reference
            passes[-1]["kind"] = "train"
            if args.lora_rank:
                passes[0]["adapters"] = False
            splits = dict.fromkeys(phases, 0.0)
            for name, dt in schedule_times:
                splits[name] += dt
            splits["optimizer"] = t1 - t_opt
            splits["other"] = (t1 - t0) - sum(splits.values())
            record = dict(step=step, step_time_s=t1 - t0, counters=counters, splits=splits,
                          passes=[dict(p) for p in passes])
            if measure_memory:
                peaks = dict.fromkeys(phases + ["optimizer"], 0.0)
                for name, v in zip([n for n, _ in schedule_times] + ["optimizer"], phase_peaks):
                    peaks[name] = max(peaks[name], float(v))
                by_phase = torch.tensor(list(peaks.values()), dtype=torch.float64, device=acc.device)
                if dist.is_initialized():
                    dist.all_reduce(by_phase, op=dist.ReduceOp.MAX)
                record["peak_mem_by_phase_bytes"] = dict(zip(phases + ["optimizer"], map(int, by_phase.tolist())))
            if allocations:  # every rank joins the reduction; a rank without a figure voids it
                box = torch.tensor([float(alloc[0]) if alloc else 0.0, 0.0 if alloc else 1.0],
                                   dtype=torch.float64, device=acc.device)
                if dist.is_initialized():
                    dist.all_reduce(box, op=dist.ReduceOp.MAX)
                record["peak_alloc_bytes"] = int(box[0].item()) if box[1].item() == 0 else None
                record["live_at_peak"] = [[label, size] for label, size in alloc[1][:8]] if alloc else []
            return record

        for step in range(args.warmup):
            one_step(step, measure_memory=False)
        timed = range(args.warmup, args.warmup + args.steps)
        records = [one_step(step, measure_memory=False) for step in timed]
        # The same steps again (same pruning draws) for memory: a window per phase, max over phases.
        # Nothing is timed from here on, so CPU RSS may follow live tensors at the cost of page faults.
        acc.track_live_memory()
        for record, step in zip(records[: args.memory_steps], timed):
            measured = one_step(step, measure_memory=True)
            record["peak_mem_by_phase_bytes"] = by_phase = measured["peak_mem_by_phase_bytes"]
            record["peak_mem_bytes"] = max(by_phase.values())
        # The allocator peak comes from one more replay under the profiler, whose own event buffers
        # would inflate that step's RSS.
        traced = one_step(timed[0], measure_memory=True, allocations=True)
        records[0]["peak_alloc_bytes"] = traced["peak_alloc_bytes"]
        records[0]["live_at_peak"] = traced["live_at_peak"]
        if args.profile:  # an extra, unrecorded step: the profiler's overhead stays out of the figures
            one_step(timed[-1], measure_memory=False, profile=True)
        step_mod.run_schedule = original_schedule
        if is_logging_rank():
            result = dict(mode=args.worker, records=records, padded_vocab=padded_vocab_size(arch.vocab_size),
                          world_size=dist.get_world_size() if dist.is_initialized() else 1,
                          state_mem_bytes=state_bytes(policy, reference, optimizer),
                          device=acc.kind, torch=torch.__version__,
                          device_name=torch.cuda.get_device_name() if acc.kind == "cuda" else platform.processor())
            with open(args.worker_out, "w") as f:
                json.dump(result, f)
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def state_bytes(policy, reference, optimizer) -> int:
    """This rank's persistent training tensors: weights (policy, and the reference when it is a
    separate model), gradient buffers and optimizer state (fp32 main copies included)."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.dim() > 0 and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for chunk in [*policy, *reference]:
        for p in chunk.parameters():
            add(p)
    for chunk in policy:
        for buf in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            add(buf.grad_data)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", []):
            for p in group:
                add(p)
        for state in opt.optimizer.state.values():
            for t in state.values():
                add(t)
    return total


# --------------------------------------------------------------------------------------- parent
def launch(args, mode: str, out_path: str, *, lora_rank: int | None = None) -> None:
    here = os.path.abspath(__file__)
    worker = [here, "--worker", mode, "--worker-out", out_path, "--preset", args.preset,
              "--pairs", str(args.pairs), "--micro-batch-size", str(args.micro_batch_size),
              "--max-seq-length", str(args.max_seq_length), "--max-prompt-length", str(args.max_prompt_length),
              "--warmup", str(args.warmup),
              "--steps", str(args.steps), "--memory-steps", str(args.memory_steps), "--device", args.device,
              "--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
              "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size),
              "--lora-rank", str(args.lora_rank if lora_rank is None else lora_rank)]
    if args.data_path:
        worker += ["--data-path", *args.data_path]
    if args.recompute_activations:
        worker.append("--recompute-activations")
    if args.skip_invalid_records:
        worker.append("--skip-invalid-records")
    if args.profile:
        worker += ["--profile", args.profile]
    nproc = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *worker]
    else:
        cmd = [sys.executable, *worker]
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    print(f"[bench_dpo] {mode}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env)


def summarise(mode: str, raw: dict, *, shape: flop_model.Shape, recompute: bool, bytes_per_elem: int,
              lora_rank: int = 0) -> dict:
    recs = raw["records"]
    times = [r["step_time_s"] for r in recs]
    measured = [r for r in recs if "peak_mem_bytes" in r]  # the first --memory-steps records
    mems = [r["peak_mem_bytes"] for r in measured]
    n = len(recs)
    counters = {k: sum(r["counters"][k] for r in recs) / n for k in recs[0]["counters"]}
    flops = {"ideal": 0.0, "padded": 0.0}
    model_mem = []
    for r in recs:
        passes = flop_model.passes_from_dict(r["passes"])
        for view in flops:
            flops[view] += flop_model.step_flops(shape, passes, recompute=recompute, view=view,
                                                 lora_rank=lora_rank)["total"] / n
        if "peak_mem_bytes" in r:
            model_mem.append(flop_model.step_peak_bytes(shape, passes, recompute=recompute,
                                                        bytes_per_elem=bytes_per_elem, lora_rank=lora_rank))
    splits = {k: statistics.median(r["splits"].get(k, 0.0) for r in recs) for k in recs[0]["splits"]}
    mem_phases = {k: statistics.median(r["peak_mem_by_phase_bytes"][k] for r in measured)
                  for k in measured[0]["peak_mem_by_phase_bytes"]}
    alloc = next((r for r in measured if "peak_alloc_bytes" in r), {})
    q = statistics.quantiles(times, n=4, method="inclusive") if n >= 2 else [times[0]] * 3  # within min..max
    return {
        "step_time_s": statistics.median(times),
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_time_iqr_s": [q[0], q[2]],
        "step_times_s": times,
        "peak_mem_bytes": statistics.median(mems),
        "peak_mem_max_bytes": max(mems),
        "state_mem_bytes": raw.get("state_mem_bytes"),
        "total_mem_bytes": raw["state_mem_bytes"] + statistics.median(mems) if "state_mem_bytes" in raw else None,
        **counters,
        "logits_elements": counters["logits_rows"] * shape.vocab,
        "flops_ideal": flops["ideal"],
        "flops_padded": flops["padded"],
        "model_peak_mem_bytes": statistics.median(model_mem),
        "model_state_mem_bytes": flop_model.state_bytes(shape, lora_rank=lora_rank, param_bytes=bytes_per_elem),
        "time_split_s": splits,
        "peak_mem_by_phase_bytes": mem_phases,
        "peak_alloc_bytes": alloc.get("peak_alloc_bytes"),
        "live_at_peak": alloc.get("live_at_peak", []),
    }


def add_ratios(modes: dict) -> None:
    base = modes["concat"]
    for m in modes.values():
        m["speedup_vs_concat"] = base["step_time_s"] / m["step_time_s"]
        m["ideal_speedup_vs_concat"] = base["flops_ideal"] / m["flops_ideal"]
        m["padded_model_speedup_vs_concat"] = base["flops_padded"] / m["flops_padded"]
        m["fraction_of_ideal_speedup"] = m["speedup_vs_concat"] / m["ideal_speedup_vs_concat"]
        m["mem_ratio_vs_concat"] = m["peak_mem_bytes"] / base["peak_mem_bytes"] if base["peak_mem_bytes"] else None
        m["model_mem_ratio_vs_concat"] = m["model_peak_mem_bytes"] / base["model_peak_mem_bytes"]
        m["alloc_mem_ratio_vs_concat"] = (m["peak_alloc_bytes"] / base["peak_alloc_bytes"]
                                          if m["peak_alloc_bytes"] and base["peak_alloc_bytes"] else None)
        m["token_ratio_vs_concat"] = (m["policy_tokens"] + m["ref_tokens"]) / (base["policy_tokens"] + base["ref_tokens"])
        # Share of the executed-token saving that became a step-time saving (sequence pruning's goal).
        saved = 1.0 - m["token_ratio_vs_concat"]
        m["token_saving_to_time"] = (1.0 - 1.0 / m["speedup_vs_concat"]) / saved if saved > 0.01 else None


def add_full_param_ratios(modes: dict, full_param: dict) -> None:
    """LoRA runs: each mode's total memory (persistent state + the step's peak) against
    full-parameter concat with an online reference, three ways: the step peak as peak RSS on CPU
    (allocator on GPU), as the tensor-allocator peak, and from the memory model."""
    def ratio(m: dict, peak_key: str, state_key: str = "state_mem_bytes"):
        if not all(x.get(k) for x in (m, full_param) for k in (peak_key, state_key)):
            return None
        return (m[state_key] + m[peak_key]) / (full_param[state_key] + full_param[peak_key])

    for m in modes.values():
        m["total_mem_ratio_vs_full_param"] = ratio(m, "peak_mem_bytes")
        m["total_alloc_mem_ratio_vs_full_param"] = ratio(m, "peak_alloc_bytes")
        m["model_total_mem_ratio_vs_full_param"] = ratio(m, "model_peak_mem_bytes", "model_state_mem_bytes")


def lora_table(modes: dict, full_param: dict) -> str:
    mb = 2**20
    lines = [f"{'mode':<16}{'state MB':>10}{'model':>8}{'step peak MB':>14}{'alloc':>8}{'total MB':>10}"
             f"{'vs full-param':>15}{'alloc':>7}{'model':>7}"]
    lines.append(f"{'(full-param)':<16}{full_param['state_mem_bytes'] / mb:>10.1f}"
                 f"{full_param['model_state_mem_bytes'] / mb:>8.1f}{full_param['peak_mem_bytes'] / mb:>14.1f}"
                 f"{_num(full_param.get('peak_alloc_bytes') and full_param['peak_alloc_bytes'] / mb, '>8.1f')}"
                 f"{full_param['total_mem_bytes'] / mb:>10.1f}{1.0:>15.2f}{1.0:>7.2f}{1.0:>7.2f}")
    for name, m in modes.items():
        lines.append(f"{name:<16}{m['state_mem_bytes'] / mb:>10.1f}{m['model_state_mem_bytes'] / mb:>8.1f}"
                     f"{m['peak_mem_bytes'] / mb:>14.1f}"
                     f"{_num(m.get('peak_alloc_bytes') and m['peak_alloc_bytes'] / mb, '>8.1f')}"
                     f"{m['total_mem_bytes'] / mb:>10.1f}{_num(m['total_mem_ratio_vs_full_param'], '>15.2f')}"
                     f"{_num(m.get('total_alloc_mem_ratio_vs_full_param'), '>7.2f')}"
                     f"{_num(m.get('model_total_mem_ratio_vs_full_param'), '>7.2f')}")
    lines.append("state: weights + reference copy + gradient buffers + optimizer state (rank 0; model: "
                 "flop_model.state_bytes); step peak: peak RSS on CPU, allocator on GPU (alloc: tensor-allocator "
                 "peak); total = state + step peak; vs full-param: total against concat without LoRA with an "
                 "online reference (alloc: with the allocator peaks; model: state and peak from the memory model)")
    return "\n".join(lines)


def _num(value, fmt: str) -> str:
    return format(value, fmt) if value is not None else format(float("nan"), fmt)


def table(modes: dict) -> str:
    head = (f"{'mode':<18}{'time s (min-max)':>22}{'speedup':>9}{'ideal':>7}{'frac':>6}{'padded':>8}"
            f"{'peak MB':>9}{'mem':>6}{'alloc':>7}{'model':>7}{'pol tok':>9}{'ref tok':>9}{'pad tok':>9}"
            f"{'tok>t':>7}{'logits':>11}")
    lines = [head, "-" * len(head)]
    for name, m in modes.items():
        lines.append(
            f"{name:<18}{m['step_time_s']:>8.3f} ({m['step_time_min_s']:.3f}-{m['step_time_max_s']:.3f})"
            f"{m['speedup_vs_concat']:>9.3f}{m['ideal_speedup_vs_concat']:>7.3f}{m['fraction_of_ideal_speedup']:>6.2f}"
            f"{m['padded_model_speedup_vs_concat']:>8.3f}{m['peak_mem_bytes'] / 2**20:>9.1f}"
            f"{_num(m['mem_ratio_vs_concat'], '>6.2f')}{_num(m.get('alloc_mem_ratio_vs_concat'), '>7.2f')}"
            f"{m['model_mem_ratio_vs_concat']:>7.2f}"
            f"{m['policy_tokens']:>9.0f}{m['ref_tokens']:>9.0f}{m['policy_padded_tokens']:>9.0f}"
            f"{_num(m.get('token_saving_to_time'), '>7.2f')}{m['logits_elements']:>11.3g}")
    lines.append("speedup/mem: measured vs concat (mem: peak RSS on CPU, allocator on GPU; alloc: tensor allocator "
                 "peak); ideal/padded/model: FLOP (ideal, padded shapes) and memory model vs concat; "
                 "frac = speedup / ideal; tok>t = time saving / executed-token saving; tokens per step (mean)")
    return "\n".join(lines)


def memory_table(modes: dict) -> str:
    """Where each mode's peak sits: peak per phase (MB) and the largest live groups at the allocator peak."""
    lines = []
    for name, m in modes.items():
        phases = "  ".join(f"{k} {v / 2**20:.1f}" for k, v in m["peak_mem_by_phase_bytes"].items())
        top = "; ".join(f"{label} {size / 2**20:.1f}" for label, size in m.get("live_at_peak", [])[:3])
        lines.append(f"{name:<19}{phases}\n{'':<19}at the allocator peak: {top or 'n/a'}")
    return "\n".join(lines)


def plot(modes: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(modes)
    x = range(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    w = 0.38
    ax = axes[0]
    ax.bar([i - w / 2 for i in x], [modes[n]["speedup_vs_concat"] for n in names], w, label="measured")
    ax.bar([i + w / 2 for i in x], [modes[n]["ideal_speedup_vs_concat"] for n in names], w, label="FLOP ideal")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("speedup vs concat")
    ax2 = axes[1]
    w3 = 0.27
    ax2.bar([i - w3 for i in x], [modes[n]["mem_ratio_vs_concat"] or 0 for n in names], w3, label="measured")
    ax2.bar(list(x), [modes[n].get("alloc_mem_ratio_vs_concat") or 0 for n in names], w3, label="tensor allocator")
    ax2.bar([i + w3 for i in x], [modes[n]["model_mem_ratio_vs_concat"] for n in names], w3, label="memory model")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_title("peak step memory / concat (lower is better)")
    for a in axes:
        a.set_xticks(list(x))
        a.set_xticklabels(names, rotation=30, ha="right")
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return {}
    from megatron_prune.arguments import exit_without_device

    exit_without_device("bench_dpo.py", args.device)
    check_pairs(args)
    from megatron_prune.model.arch import ModelArch
    from megatron_prune.model.provider import padded_vocab_size

    arch = ModelArch(**PRESETS[args.preset]["arch"])
    shape = flop_model.Shape.from_arch(arch, vocab=padded_vocab_size(arch.vocab_size))
    bytes_per_elem = 2 if PRESETS[args.preset]["bf16"] else 4
    # concat first (every ratio is against it), then the modes in the order asked for: a run cut
    # short (bench_dpo rewrites its JSON after every mode) keeps the ones named first.
    order = ["concat"] + [m for m in dict.fromkeys(args.modes) if m != "concat"]
    config = {
        "preset": args.preset, "arch": arch.to_dict(), "padded_vocab": shape.vocab,
        "pairs": args.pairs, "micro_batch_size": args.micro_batch_size, "max_seq_length": args.max_seq_length,
        "max_prompt_length": args.max_prompt_length, "warmup": args.warmup,
        "steps": args.steps, "rounds": args.rounds, "memory_steps": min(args.memory_steps, args.steps),
        "recompute": args.recompute_activations, "device": args.device,
        "bf16": PRESETS[args.preset]["bf16"], "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size, "lora_rank": args.lora_rank,
        "data": args.data_path or ["bundled HH-RLHF sample (tiny tokenizer lengths)"],
        "head_share_fwd_flops_at_512": flop_model.head_share(shape, 512),
        "active_params_per_token": shape.active_params(),
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", "tools/bench_dpo.py", *(argv or sys.argv[1:])]),
    }
    raw_modes: dict = {}
    result = {"modes": {}, "records": {}, "config": config}
    with tempfile.TemporaryDirectory() as tmp:
        # Rounds interleave the modes, so a slow drift of the machine does not favour one of them.
        for rnd, mode in ((r, m) for r in range(args.rounds) for m in order):
            if mode in result.get("failed", {}):
                continue
            out = os.path.join(tmp, f"{mode}-{rnd}.json")
            t = time.perf_counter()
            try:
                launch(args, mode, out)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                result.setdefault("failed", {})[mode] = str(exc)
                raw_modes.pop(mode, None)
                if mode == "concat":  # the denominator of every ratio: no mode can have a row now
                    print(f"[bench_dpo] concat: FAILED ({exc}); without it no mode has a ratio, so no other mode "
                          "runs", flush=True)
                    result["modes"], result["records"] = {}, {}
                    break
                # Its finished rounds leave too: interleaved rounds are compared as a whole, and ratios of the
                # others' later rounds to a concat missing them would mix rounds.
                print(f"[bench_dpo] {mode}: FAILED ({exc}); continuing", flush=True)
            else:
                with open(out) as f:
                    raw = json.load(f)
                if mode in raw_modes:
                    raw_modes[mode]["records"].extend(raw["records"])
                else:
                    raw_modes[mode] = raw
                config["device_name"] = raw.get("device_name")
                print(f"[bench_dpo] {mode} (round {rnd + 1}/{args.rounds}): done in {time.perf_counter() - t:.0f}s, "
                      f"median step {statistics.median(r['step_time_s'] for r in raw['records']):.3f}s", flush=True)
            # After every launch, failed ones too: a failed mode leaves the table, and without concat
            # (the denominator of every ratio) no mode has a row.
            done = {m: summarise(m, raw_modes[m], shape=shape, recompute=args.recompute_activations,
                                 bytes_per_elem=bytes_per_elem, lora_rank=args.lora_rank)
                    for m in order if m in raw_modes} if "concat" in raw_modes else {}
            if done:
                add_ratios(done)
            result["modes"] = done
            result["records"] = {m: raw_modes[m]["records"] for m in order if m in done}
            if args.json:
                _write_json(args.json, result)
            if args.plot and done:  # like the JSON: a run stopped by a timeout keeps the modes it finished
                plot(done, args.plot, f"DPO pruning, {args.preset} ({config.get('device_name') or args.device})")
    if args.lora_rank and result["modes"]:
        # The memory to beat: full-parameter concat with an online reference (same data and steps).
        try:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "full-param-concat.json")
                launch(args, "concat", out, lora_rank=0)
                with open(out) as f:
                    full_param = summarise("concat", json.load(f), shape=shape,
                                           recompute=args.recompute_activations, bytes_per_elem=bytes_per_elem)
            add_full_param_ratios(result["modes"], full_param)
            result["full_param_concat"] = full_param
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            print(f"[bench_dpo] full-parameter concat: FAILED ({exc})", flush=True)
            result.setdefault("failed", {})["full_param_concat"] = str(exc)
    print(table(result["modes"]))
    if result.get("full_param_concat"):
        print(f"LoRA rank {args.lora_rank}: memory against full-parameter DPO (concat, online reference):")
        print(lora_table(result["modes"], result["full_param_concat"]))
    print("peak memory by phase (MB), and the largest live groups at the allocator peak (MB):")
    print(memory_table(result["modes"]))
    if args.json:
        _write_json(args.json, result)
        print(f"[bench_dpo] wrote {args.json}")
    if args.plot and result["modes"]:
        plot(result["modes"], args.plot, f"DPO pruning, {args.preset} ({config.get('device_name') or args.device})")
        print(f"[bench_dpo] wrote {args.plot}")
    if result.get("failed"):
        raise SystemExit(f"[bench_dpo] modes that failed (their output is above): {', '.join(result['failed'])}")
    return result


def _write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
