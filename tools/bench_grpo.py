"""GRPO vs DPPO vs a biased filter on the same prompts: per-phase time, tokens and density.

One process (one rank, CPU by default; ``--device cuda`` on a GPU machine). For each mode a
fresh policy with the same seed trains ``--steps`` GRPO steps on the same prompt stream:

* ``grpo``   — no pruning, padded rows;
* ``dppo``   — DPPO prompt + completion pruning (importance weighted) with dense packing;
* ``filter`` — the biased filter: zero-variance groups dropped after rollout, no weights
  (DAPO-style dynamic sampling without refill), padded rows.

Reported per mode: summed rollout / reference / train seconds, rollout tokens, policy tokens
trained, density, mean reward; and ratios to ``grpo``. ``--json`` prints one JSON object.

    python tools/bench_grpo.py --steps 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

MODES = ("grpo", "dppo", "filter")


class ZeroVarianceFilter:
    """Biased filter: keep every prompt, drop the completions of groups with equal rewards."""

    def __init__(self) -> None:
        from megatron_prune.grpo.dppo import KeepDecision

        self._decision = KeepDecision

    def select_prompts(self, *, step, prompt_ids):
        ones = torch.ones(len(prompt_ids), dtype=torch.float64)
        return self._decision(probs=ones, keep=ones.bool(), target_rate=0.0)

    def select_completions(self, *, step, prompt_ids, advantages):
        informative = (advantages != 0).any(dim=1, keepdim=True).expand_as(advantages)
        return self._decision(probs=torch.ones(advantages.shape, dtype=torch.float64), keep=informative.clone(),
                              target_rate=0.0)

    def observe(self, *, prompt_ids, rewards) -> None:
        pass

    def state_dict(self) -> dict:
        return {}


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.trainer import build_objective, toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    with model_parallel(par, seed=args.seed):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=args.seed)
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam", lr=args.lr, clip_grad=1.0), bf16=False)
        dppo = DPPOArgs(prompt_prune_rate=args.prompt_rate, completion_prune_rate=args.completion_rate,
                        dense_packing=True) if mode == "dppo" else DPPOArgs()
        configs = {
            "TrainConfig": TrainConfig(global_batch_size=args.prompts, micro_batch_size=args.micro_batch_size,
                                       seq_length=args.pack_capacity, seed=args.seed),
            "GRPOConfig": GRPOConfig(group_size=args.group_size, max_new_tokens=args.max_new_tokens),
            "DPPOArgs": dppo,
        }
        source = toy_source(vocab_size=arch.vocab_size, num_prompts=args.num_prompts, seed=args.seed)
        objective = build_objective(configs=configs, arch=arch, policy=policy, reference=None, source=source)
        if mode == "filter":
            objective.pruner = ZeroVarianceFilter()
        totals = dict(rollout_time_s=0.0, reference_time_s=0.0, train_time_s=0.0, rollout_tokens=0.0,
                      policy_tokens=0.0, slots=0.0, reward=0.0)
        start = time.perf_counter()
        for step in range(args.steps):
            for chunk in policy:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            m = objective.train_step(step)
            optimizer.step()
            for key in ("rollout_time_s", "reference_time_s", "train_time_s", "rollout_tokens", "policy_tokens"):
                totals[key] += m[key]
            totals["slots"] += m["policy_tokens"] / m["density"] if m["density"] else 0.0
            totals["reward"] += m["reward_mean"] / args.steps
        totals["wall_s"] = time.perf_counter() - start
    totals["density"] = totals["policy_tokens"] / totals["slots"] if totals["slots"] else 1.0
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--num-prompts", type=int, default=32, help="toy prompt set (prompts recur every few steps)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=16, help="rows per training microbatch")
    parser.add_argument("--pack-capacity", type=int, default=128)
    parser.add_argument("--prompt-rate", type=float, default=0.3)
    parser.add_argument("--completion-rate", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from megatron_prune.training.parallel import initialize_distributed

    initialize_distributed(timeout_minutes=5)
    results = {mode: run_mode(mode, args) for mode in args.modes}
    base = results.get("grpo")
    if base:
        for mode, r in results.items():
            r["speedup_train_vs_grpo"] = base["train_time_s"] / r["train_time_s"] if r["train_time_s"] else None
            r["speedup_rollout_vs_grpo"] = base["rollout_time_s"] / r["rollout_time_s"] if r["rollout_time_s"] else None
            r["speedup_total_vs_grpo"] = base["wall_s"] / r["wall_s"]
            r["policy_token_ratio_vs_grpo"] = r["policy_tokens"] / base["policy_tokens"]
            r["rollout_token_ratio_vs_grpo"] = r["rollout_tokens"] / base["rollout_tokens"]
    if args.json:
        print(json.dumps({"config": vars(args), "results": results}, indent=1))
    else:
        for mode, r in results.items():
            print(mode, " ".join(f"{k}={v:.4g}" for k, v in r.items() if isinstance(v, float)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
