"""GRPO vs DPPO vs biased baselines: held-out reward against training wall-clock, per-step records.

Every (round, seed) runs in a fresh process (``torchrun --nproc-per-node TP*PP`` when TP*PP > 1)
that trains each mode from the same initial policy (same seed) on the same prompt stream, through
the GRPO trainer's own objective (rollout, rewards, pruning, packing, the training passes) and
Adam. ``grpo`` runs first and sets the time budget: with ``--match-time`` (the default) every
other mode keeps training past ``--steps`` until its cumulative training time reaches GRPO's
(at most ``--max-step-factor`` x ``--steps`` steps), so equal-wall-clock comparisons need no
extrapolation.

Modes (DPPO rates from ``--prompt-rate`` / ``--completion-rate``):

================  ==================================================================  ========
mode              what is pruned                                                      estimator
================  ==================================================================  ========
grpo              nothing but the zero-advantage completions (exact without KL;       unbiased
                  ``--no-skip-zero-advantage`` trains them too); one sequence per row
dppo              prompts before rollout and completions after it, weights 1/(p q),   unbiased
                  dense packing
dppo_completion   completions only (rate r_o), weights 1/q, dense packing             unbiased
dppo_prompt       prompts only (rate r_q), weights 1/p, dense packing                 unbiased
filter            after rollout, every group whose rewards are all equal (DAPO-style  biased
                  dynamic sampling without refill), no weights, dense packing
cppo              in each group, the round(r_o G) completions with the smallest |A|   biased
                  (CPPO-style), no weights, dense packing
grpo_shared       grpo with --shared-prompt: each group's completions behind one      unbiased
                  prompt copy (exact: grpo's run on fewer training-pass tokens)
dppo_shared       dppo with --shared-prompt (several groups per packed row)           unbiased
================  ==================================================================  ========

The ``*_shared`` modes run only when asked for (``--modes``); the table's ``train tok`` column
is the training-pass tokens relative to ``grpo``'s, ``train s`` the training-pass time.

``filter`` and ``cppo`` are benchmark baselines: this tool swaps the objective's pruner for a
deterministic keep rule (keep probability 1, so weight 1); nothing in the trainer changes.

Held-out reward: every ``--eval-every`` steps (and before the first and after the last step),
``--eval-prompts`` prompts that training never sees are sampled ``--eval-samples`` times each
with a fixed seed (common random numbers: every mode and step draws the same uniforms) at
``--eval-temperature`` (0 = greedy), and the mean reward is recorded. Evaluation time is not
training time. The time of a step is its rollout, reference and old log-prob passes, training
passes and optimizer step.

``--grad-variance K``: on every ``--grad-variance-every``-th step (before that step's update, at
the current parameters, not counted in training time) the unpruned GRPO gradient ``g`` of one
rollout of the step's prompts is compared with ``K`` pruned gradients ``g_k`` of the same
rollout (the mode's keep rule with ``K`` independent draws): ``grad_rel_mse = mean_k |g_k -
g|^2 / |g|^2`` (variance plus squared bias) and ``grad_rel_bias = |mean_k g_k - g|^2 / |g|^2``.

Output: a table, ``--json`` (top level ``config`` and ``modes``; contract, every key under
``modes.<mode>``: ``modes.<mode>.speedup_vs_grpo`` (median per-step wall-clock ratio),
``modes.<mode>.heldout_reward_final``, ``modes.<mode>.heldout_reward_at_grpo_time`` (each seed at
the training time GRPO needed for its final step with that seed, then the mean over seeds),
``modes.<mode>.heldout_reward_at_grpo_steps``, ``modes.<mode>.records`` (one dict per step and
seed)), and ``--plot``
(held-out reward vs cumulative training wall-clock, mean and min-max over seeds, per mode).

    python tools/bench_grpo.py --task toy --seeds 5 --steps 40 --json /tmp/g.json --plot /tmp/g.png
    python tools/bench_grpo.py --task gsm8k --modes grpo dppo --steps 4 --kv-cache --no-match-time
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("grpo", "dppo", "dppo_completion", "dppo_prompt", "filter", "cppo", "grpo_shared", "dppo_shared")
SHARED_SUFFIX = "_shared"
TASKS = ("toy", "toy-binary", "gsm8k")
PHASES = ("rollout_time_s", "reference_time_s", "old_logprob_time_s", "update_time_s", "optimizer_time_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_prune.arguments import (ToolHelpFormatter, above, at_least, refuse_bad_data_files,
                                          refuse_plot_without_matplotlib,
                                          refuse_unrunnable_layout, refuse_unwritable_outputs)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    p.add_argument("--task", choices=TASKS, default="toy", help="the task trained and evaluated")
    p.add_argument("--modes", nargs="+", choices=MODES, default=[m for m in MODES if not m.endswith(SHARED_SUFFIX)],
                   help="modes to run (grpo is always added: it is the baseline)")
    p.add_argument("--seeds", type=at_least(1), default=3, help="seeds (policy initialisation, prompts and draws)")
    p.add_argument("--seed", type=int, default=1234, help="first seed; seeds are seed, seed+1, ...")
    p.add_argument("--steps", type=at_least(1), default=40, help="GRPO steps (other modes: see --match-time)")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="repeat every (seed, mode) run this many times, interleaved (timing on noisy machines)")
    p.add_argument("--match-time", action=argparse.BooleanOptionalAction, default=True,
                   help="train other modes until their training time reaches GRPO's (same seed and round)")
    p.add_argument("--max-step-factor", type=at_least(1.0, float), default=4.0,
                   help="with --match-time: at most this x --steps")
    p.add_argument("--prompts", type=at_least(1), default=32, help="prompts per step (global batch)")
    p.add_argument("--num-prompts", type=at_least(1), default=64,
                   help="training prompt set (gsm8k: the first N problems; they recur, so prompt pruning has history)")
    p.add_argument("--group-size", type=at_least(2), default=8,
                   help="completions per prompt (G; at least 2: advantages are relative to the group)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=None, help="default: 4 (toy tasks), 64 (gsm8k)")
    p.add_argument("--micro-batch-size", type=at_least(1), default=None,
                   help="rows per training microbatch (default: --prompts)")
    p.add_argument("--rollout-micro-batch-size", type=at_least(1), default=None,
                   help="sequences (completions) per rollout forward (default: the trainer's)")
    p.add_argument("--seq-length", type=at_least(2), default=None, help="packing capacity (default: 64 toy, 512 gsm8k)")
    p.add_argument("--toy-prompt-length", type=at_least(3), default=3, help="prompt tokens of the toy tasks")
    p.add_argument("--data-path", nargs="+", default=None, help="gsm8k problems (default: the bundled sample)")
    p.add_argument("--max-prompt-length", type=at_least(1), default=None,
                   help="gsm8k prompts keep their last N tokens (default 256)")
    p.add_argument("--prompt-rate", type=float, default=0.5, help="r_q of dppo and dppo_prompt")
    p.add_argument("--completion-rate", type=float, default=0.5, help="r_o of dppo, dppo_completion and cppo")
    p.add_argument("--dppo-sampling", default=None, choices=("independent", "systematic"),
                   help="DPPO's completion keep draws (the trainer's --dppo-sampling; default: the trainer's default)")
    p.add_argument("--dppo-prompt-sampling", default=None, choices=("independent", "systematic"),
                   help="DPPO's prompt keep draws (the trainer's --dppo-prompt-sampling; default: the trainer's default)")
    p.add_argument("--dppo-history-score", default=None, choices=("std", "informative", "pass-rate"),
                   help="what DPPO's prompt history scores (the trainer's --dppo-history-score; default: the trainer's)")
    p.add_argument("--prompt-floor", type=float, default=None,
                   help="DPPO's prompt keep-probability floor (the trainer's --dppo-prompt-floor; default: the trainer's)")
    p.add_argument("--completion-floor", type=float, default=None,
                   help="DPPO's completion keep-probability floor (the trainer's --dppo-completion-floor; "
                        "default: the trainer's)")
    p.add_argument("--no-skip-zero-advantage", dest="skip_zero_advantage", action="store_false",
                   help="train zero-advantage completions too (the trainer's --no-skip-zero-advantage; by default "
                        "every mode leaves them out when --kl-beta is 0, which is exact)")
    p.add_argument("--lr", type=above(0), default=5e-3, help="Adam learning rate of every mode")
    p.add_argument("--clip-grad", type=at_least(0.0, float), default=1.0, help="global gradient-norm clip (0 = none)")
    p.add_argument("--kl-beta", type=at_least(0.0, float), default=0.0,
                   help="k3 KL to a frozen reference (adds its forward pass)")
    p.add_argument("--ppo-epochs", type=at_least(1), default=1, help="passes over each step's rollout")
    p.add_argument("--minibatches", type=at_least(1), default=1, help="optimizer steps per PPO epoch")
    p.add_argument("--temperature", type=above(0), default=1.0, help="rollout sampling temperature")
    p.add_argument("--kv-cache", action="store_true", help="KV-cached rollout (any TP / PP / VPP layout)")
    p.add_argument("--eval-every", type=at_least(1), default=5,
                   help="held-out evaluation every N steps (not counted in training time)")
    p.add_argument("--eval-prompts", type=at_least(1), default=64, help="held-out prompts")
    p.add_argument("--eval-samples", type=at_least(1), default=4, help="fixed-seed samples per held-out prompt")
    p.add_argument("--eval-temperature", type=at_least(0.0, float), default=1.0, help="0 = greedy")
    p.add_argument("--grad-variance", type=at_least(0), default=0, metavar="K",
                   help="pruned-gradient draws compared with the unpruned gradient on sampled steps (0 = off)")
    p.add_argument("--grad-variance-every", type=at_least(1), default=10, help="with --grad-variance: every N steps")
    p.add_argument("--tensor-model-parallel-size", type=at_least(1), default=1,
                   help="TP of every run (above 1 the tool starts torchrun itself)")
    p.add_argument("--pipeline-model-parallel-size", type=at_least(1), default=1,
                   help="PP of every run (above 1 the tool starts torchrun itself)")
    p.add_argument("--virtual-pipeline-model-parallel-size", type=at_least(2), default=None,
                   help="model chunks per pipeline rank (interleaved schedule) of every run")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (needs TP > 1)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help="accelerator of every run")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch intra-op threads per rank (CPU)")
    p.add_argument("--json", metavar="PATH", help="write the results (rewritten after every run)")
    p.add_argument("--plot", metavar="PATH", help="PNG: held-out reward vs cumulative training time")
    p.add_argument("--timeout", type=above(0), default=3600.0, help="seconds per (round, seed) process")
    p.add_argument("--from-json", metavar="PATH", nargs="+",
                   help="summarise and plot the records of earlier runs' JSON files (e.g. two batches of seeds) "
                        "instead of running; the files must hold the same experiment (config and modes; only seeds, "
                        "rounds, host and times may differ) and no (seed, round) run twice")
    p.add_argument("--seeds-per-process", type=at_least(1), default=1,
                   help="seeds trained one after another in one worker process (saves start-up time)")
    p.add_argument("--worker-seeds", help=argparse.SUPPRESS)
    p.add_argument("--worker-round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    toy = args.task != "gsm8k"
    if args.max_new_tokens is None:
        args.max_new_tokens = 4 if toy else 64
    if args.seq_length is None:
        args.seq_length = 64 if toy else 512
    if args.micro_batch_size is None:
        args.micro_batch_size = args.prompts
    if args.prompts > args.num_prompts:
        p.error(f"--prompts {args.prompts} asks for {args.prompts} different prompts a step, but --num-prompts is "
                f"{args.num_prompts}: lower --prompts or raise --num-prompts")
    if "grpo" not in args.modes:
        args.modes = ["grpo"] + list(args.modes)
    args.modes = [m for m in MODES if m in args.modes]
    for mode in args.modes:  # refuse rates and floors the objective would refuse, before any worker starts
        try:
            dppo_args(mode, args)
        except ValueError as exc:
            p.error(f"mode {mode} (--prompt-rate, --completion-rate, --prompt-floor, --completion-floor): {exc}")
    refuse_plot_without_matplotlib(p, args.plot)
    refuse_unwritable_outputs(p, json=args.json, plot=args.plot)
    from megatron_prune.model.arch import get_preset

    refuse_unrunnable_layout(p, get_preset("tiny"), tp=args.tensor_model_parallel_size,
                             pp=args.pipeline_model_parallel_size, vpp=args.virtual_pipeline_model_parallel_size,
                             sp=args.sequence_parallel)
    if args.task != "gsm8k":  # the toy tasks make their own prompts
        for flag, value in (("--data-path", args.data_path), ("--max-prompt-length", args.max_prompt_length)):
            if value is not None:
                p.error(f"{flag} is for --task gsm8k; --task {args.task} makes its own prompts")
    args.max_prompt_length = args.max_prompt_length or 256
    from megatron_prune.arguments import UsageError
    from megatron_prune.grpo.config import check_lengths

    try:  # the trainer's own refusal: a prompt and its completion must fit in one sequence
        check_lengths(seq_length=args.seq_length, max_new_tokens=args.max_new_tokens,
                      max_prompt_length=args.max_prompt_length if args.task == "gsm8k" else None,
                      toy_prompt_length=None if args.task == "gsm8k" else args.toy_prompt_length)
    except UsageError as exc:
        p.error(str(exc))
    refuse_bad_data_files(p, "--data-path", args.data_path)
    if args.from_json:
        given = [a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")]
        ignored = [flag for flag in dict.fromkeys(given) if flag not in ("--from-json", "--json", "--plot")]
        if ignored:
            p.error(f"--from-json summarises the runs its files hold, so {', '.join(ignored)} would change nothing; "
                    "drop {}".format("it" if len(ignored) == 1 else "them"))
        try:
            args.earlier = load_earlier(args.from_json)
        except ValueError as exc:
            p.error(f"--from-json {exc}")
    return args


MAY_DIFFER = {"seed", "seeds", "seeds_per_process", "rounds", "timeout", "json", "plot", "from_json", "date",
              "loadavg_start", "loadavg_end", "command", "host", "cpus", "python", "device_name", "batches"}
"""Config keys in which the batches ``--from-json`` merges may differ: which seeds and rounds each
ran, and where and when. Every other key shapes the experiment and must agree."""


def load_earlier(paths: list[str]) -> tuple[dict, dict[str, list[dict]]]:
    """The merged config and records of earlier runs' JSON files: ValueError (naming the file)
    for a file that is not such a result, or for batches that do not belong together (another
    experiment's config, other modes, or a (seed, round) run that two files hold)."""
    earlier = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            raw["config"], raw["modes"]  # noqa: B018 (a result's two parts)
            if not raw["modes"] or any(mode not in MODES or not isinstance(summary.get("records"), list)
                                       for mode, summary in raw["modes"].items()):
                raise KeyError("records")  # e.g. tools/bench_dpo.py's result: other modes, no per-mode records
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
            raise ValueError(f"{path}: not a JSON result of tools/bench_grpo.py") from None
        earlier.append((path, raw))
    first_path, first = earlier[0]
    seen: dict[tuple[str, int, int], str] = {}
    for path, raw in earlier:
        differ = sorted(k for k in set(first["config"]) | set(raw["config"])
                        if k not in MAY_DIFFER and first["config"].get(k) != raw["config"].get(k))
        if differ:
            shown = ", ".join(f"{k} {raw['config'].get(k)!r} (in {first_path}: {first['config'].get(k)!r})"
                              for k in differ[:4])
            raise ValueError(f"{path}: another experiment than {first_path}: {shown}")
        if set(raw["modes"]) != set(first["modes"]):
            raise ValueError(f"{path}: modes {sorted(raw['modes'])}, {first_path}: {sorted(first['modes'])}")
        for mode, summary in raw["modes"].items():
            for key in {(r["seed"], r.get("round", 0)) for r in summary["records"]}:
                if (mode, *key) in seen:
                    raise ValueError(f"{path}: mode {mode} seed {key[0]} round {key[1]} is also in "
                                     f"{seen[(mode, *key)]}: each (seed, round) run may come from one file only")
                seen[(mode, *key)] = path
    config = dict(first["config"])
    config["seeds"] = len({seed for _, seed, _ in seen})
    config["batches"] = [{k: raw["config"].get(k) for k in ("seed", "seeds", "date", "loadavg_start", "loadavg_end",
                                                             "command")} for _, raw in earlier]
    records = {m: [r for _, raw in earlier for r in raw["modes"][m]["records"]] for m in first["modes"]}
    return config, records


# --------------------------------------------------------------------------------------- keep rules
class _KeepAll:
    """No pruning at all (the unpruned reference of the gradient-variance measurement). Its prompt
    history stays empty, as the trainer's pruner's would with prompt pruning off."""

    def __init__(self) -> None:
        from megatron_prune.grpo.dppo import PromptHistory

        self.history = PromptHistory()

    def select_prompts(self, *, step, prompt_ids):
        from megatron_prune.grpo.dppo import KeepDecision
        import torch

        n = len(prompt_ids)
        return KeepDecision(probs=torch.ones(n, dtype=torch.float64), keep=torch.ones(n, dtype=torch.bool),
                            target_rate=0.0)

    def select_completions(self, *, step, prompt_ids, advantages):
        from megatron_prune.grpo.dppo import KeepDecision
        import torch

        return KeepDecision(probs=torch.ones(advantages.shape, dtype=torch.float64),
                            keep=torch.ones(advantages.shape, dtype=torch.bool), target_rate=0.0)

    def observe(self, *, prompt_ids, rewards) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ZeroVarianceFilter(_KeepAll):
    """Biased (DAPO-style dynamic sampling without refill): after rollout, drop every group whose
    rewards are all equal; no importance weights. With ``skip_zero`` (what every mode does at
    ``--kl-beta 0``, where it is exact) any other zero-advantage completion is left out too."""

    def __init__(self, *, skip_zero: bool) -> None:
        super().__init__()
        self.skip_zero = skip_zero

    def select_completions(self, *, step, prompt_ids, advantages):
        decision = super().select_completions(step=step, prompt_ids=prompt_ids, advantages=advantages)
        keep = (advantages != 0).any(dim=1, keepdim=True).expand_as(advantages).clone()
        if self.skip_zero:
            keep &= advantages != 0
        return type(decision)(probs=decision.probs, keep=keep, target_rate=0.0)


class SmallestAdvantageDrop(_KeepAll):
    """Biased (CPPO-style): in each group drop the ``round(rate * G)`` completions with the smallest
    |A| (ties: the lower index is dropped first); no importance weights. With ``skip_zero`` every
    zero-advantage completion is left out too (a zero-variance group keeps none), as in every
    other mode at ``--kl-beta 0``."""

    def __init__(self, rate: float, *, skip_zero: bool) -> None:
        super().__init__()
        self.rate = rate
        self.skip_zero = skip_zero

    def select_completions(self, *, step, prompt_ids, advantages):
        import torch

        decision = super().select_completions(step=step, prompt_ids=prompt_ids, advantages=advantages)
        drop = round(self.rate * advantages.shape[1]) if advantages.numel() else 0
        keep = torch.ones(advantages.shape, dtype=torch.bool)
        if drop:
            order = torch.sort(advantages.abs(), dim=1, stable=True).indices[:, :drop]
            keep.scatter_(1, order, False)
        if self.skip_zero:
            keep &= advantages != 0
        return type(decision)(probs=decision.probs, keep=keep, target_rate=self.rate)


def dppo_args(mode: str, args):
    from megatron_prune.grpo.config import DPPOArgs

    shared = mode.endswith(SHARED_SUFFIX)
    mode = mode.removesuffix(SHARED_SUFFIX)
    rates = {"grpo": (0.0, 0.0), "dppo": (args.prompt_rate, args.completion_rate),
             "dppo_completion": (0.0, args.completion_rate), "dppo_prompt": (args.prompt_rate, 0.0),
             "filter": (0.0, 0.0), "cppo": (0.0, 0.0)}[mode]
    chosen = {"sampling": args.dppo_sampling, "prompt_sampling": args.dppo_prompt_sampling,
              "history_score": args.dppo_history_score,
              "prompt_floor": args.prompt_floor, "completion_floor": args.completion_floor}
    extra = {k: v for k, v in chosen.items() if v is not None}
    return DPPOArgs(prompt_prune_rate=rates[0], completion_prune_rate=rates[1], dense_packing=mode != "grpo",
                    shared_prompt=shared, skip_zero_advantage=args.skip_zero_advantage, **extra)


# --------------------------------------------------------------------------------------- worker
def _source(args, *, arch, seed: int, heldout: bool):
    """Training prompts, or the held-out prompts (never trained on)."""
    from megatron_prune.grpo.trainer import PromptSource, math_source, toy_source

    if args.task != "gsm8k":
        n = args.num_prompts + (args.eval_prompts if heldout else 0)
        src = toy_source(vocab_size=arch.vocab_size, num_prompts=n, seed=seed, prompt_length=args.toy_prompt_length,
                         binary=args.task == "toy-binary")
        if not heldout:
            return src
        offset = args.num_prompts
    else:
        from megatron_prune.data import GSM8K_SAMPLE
        from megatron_prune.data.tokenizer import load_tokenizer

        full = math_source(task="gsm8k", paths=args.data_path or [GSM8K_SAMPLE], tokenizer=load_tokenizer("tiny"),
                           max_prompt_length=args.max_prompt_length)
        n_eval = min(args.eval_prompts, len(full) // 4)
        if not heldout:
            return PromptSource(size=min(len(full) - n_eval, args.num_prompts), get=full.get, score=full.score,
                                eos_id=full.eos_id, pad_id=full.pad_id)
        src, offset = full, len(full) - n_eval
    return PromptSource(size=src.size - offset, get=lambda i: src.get(offset + i), score=src.score,
                        eos_id=src.eos_id, pad_id=src.pad_id)


def heldout_reward(objective, heldout, args) -> float:
    """Mean reward of fixed-seed samples (or greedy completions) on the held-out prompts."""
    from megatron_prune.grpo.rollout import SamplingSettings, generate

    settings = SamplingSettings(
        max_new_tokens=args.max_new_tokens, eos_id=heldout.eos_id, pad_id=heldout.pad_id,
        vocab_size=objective.sampling.vocab_size, seed=987654321, temperature=args.eval_temperature,
        kv_cache=args.kv_cache, micro_batch_size=args.rollout_micro_batch_size)
    prompts = [heldout.get(i) for i in range(len(heldout))]
    samples = 1 if args.eval_temperature == 0 else args.eval_samples
    groups = generate(model=objective.runner.policy, prompts=[(k, p.tokens) for k, p in enumerate(prompts)],
                      group_size=samples, settings=settings, step=0)
    scores = [heldout.score(p, c.tokens) for p, group in zip(prompts, groups) for c in group]
    return sum(scores) / len(scores)


def _flat_grad(policy):
    """This rank's share of the gradient: every weight once over the model-parallel group.

    A weight replicated over TP (norms, a replicated adapter factor) holds the same reduced gradient
    on every TP rank, and a tied embedding is on the first and the last pipeline stage; both count
    on one rank only, as Megatron's gradient norm counts them, so the sum over ranks is the norm.
    """
    import torch
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return torch.cat([p.main_grad.detach().reshape(-1).double().clone() for chunk in policy
                      for p in chunk.parameters()
                      if p.requires_grad and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)])


def _model_parallel_sum(values):
    """Sum of per-rank partial sums over the model-parallel group (TP x PP shards of the gradient)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized() and parallel_state.get_model_parallel_group() is not None:
        dist.all_reduce(values, group=parallel_state.get_model_parallel_group())
    return values


def gradient_variance(objective, *, rule, step: int, draws: int) -> dict:
    """Unpruned vs pruned gradients on one rollout of this step's prompts (see the module docs)."""
    import dataclasses

    import torch

    from megatron_prune.grpo.dppo import combine_weights

    policy = objective.runner.policy
    rollout = step // objective.grpo.updates_per_rollout
    saved_pruner, saved_sampler = objective.pruner, objective.sampler.state_dict()
    saved_before = objective._before_buffer
    if objective.buffer is not None and objective.buffer.index == rollout:
        # a step inside a rollout (--ppo-epochs, --minibatches): the sampler has moved past its prompts
        objective.sampler.load_state_dict(saved_before["sampler"])
    objective.pruner = _KeepAll()
    try:
        full = objective._rollout(rollout)  # every prompt, every completion, weight 1; the training draws' keys
    finally:
        objective.pruner, objective._before_buffer = saved_pruner, saved_before
        objective.sampler.load_state_dict(saved_sampler)
    items = [it for mb in full.minibatches for it in mb]
    normaliser = sum(full.normalisers)

    def grad_of(chosen):
        for chunk in policy:
            chunk.zero_grad_buffer()
            # After an optimizer step each param.grad aliases its main_grad; a backward into that
            # alias would count the gradient twice (the training loop clears it with zero_grad()).
            for p in chunk.parameters():
                p.grad = None
        objective.runner.train(objective._mine(chosen), normaliser=normaliser)
        return _flat_grad(policy)

    g = grad_of(items)
    groups: dict = {}
    for it in items:
        groups.setdefault(it.prompt_id, []).append(it)
    ids = list(groups)
    advantages = torch.tensor([[it.advantage for it in sorted(groups[i], key=lambda t: t.index)] for i in ids])
    sq, draws_sum = [], torch.zeros_like(g)
    for k in range(draws):
        draw_step = 1_000_000 + 1000 * step + k  # keys no training draw uses
        prompts = rule.select_prompts(step=draw_step, prompt_ids=ids)
        kept = [i for i, keep in zip(ids, prompts.keep.tolist()) if keep]
        rows = [ids.index(i) for i in kept]
        completions = rule.select_completions(step=draw_step, prompt_ids=kept, advantages=advantages[rows])
        weights = combine_weights(prompt_weights=prompts.weights[prompts.keep], completion_weights=completions.weights)
        chosen = []
        for r, i in enumerate(kept):
            for it in sorted(groups[i], key=lambda t: t.index):
                if completions.keep[r, it.index]:
                    chosen.append(dataclasses.replace(it, weight=float(weights[r, it.index])))
        gk = grad_of(chosen)
        draws_sum += gk
        sq.append(float(((gk - g) ** 2).sum()))
    for chunk in policy:
        chunk.zero_grad_buffer()
    totals = _model_parallel_sum(torch.tensor([sum(sq) / draws, float(((draws_sum / draws - g) ** 2).sum()),
                                               float((g ** 2).sum())], dtype=torch.float64))
    norm = float(totals[2]) or float("nan")
    return {"grad_rel_mse": float(totals[0]) / norm, "grad_rel_bias": float(totals[1]) / norm}


def run_mode(mode: str, args, *, seed: int, budget_s: float | None, warmup: bool = False) -> list[dict]:
    """Train ``mode`` from the seed's initial policy; one record per step (step -1: the evaluation
    before training). ``warmup``: one step, no evaluation (first-call costs of the process)."""
    from megatron_prune.accelerator import get_accelerator
    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import GRPOConfig
    from megatron_prune.grpo.trainer import build_objective
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    acc = get_accelerator()
    par = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                         pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                         virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                         sequence_parallel=args.sequence_parallel)
    records: list[dict] = []
    with model_parallel(par, seed=seed):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=seed)
        reference = setup_model(arch, par, seed=seed, trainable=False) if args.kl_beta > 0 else None
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam", lr=args.lr, clip_grad=args.clip_grad),
                                    bf16=False)
        max_steps = args.steps if budget_s is None else max(args.steps, int(args.steps * args.max_step_factor))
        if warmup:
            max_steps = 1
        configs = {
            "TrainConfig": TrainConfig(global_batch_size=args.prompts, micro_batch_size=args.micro_batch_size,
                                       seq_length=args.seq_length, seed=seed, train_iters=max_steps),
            "GRPOConfig": GRPOConfig(task=args.task, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                                     kl_beta=args.kl_beta, kv_cache=args.kv_cache, temperature=args.temperature,
                                     ppo_epochs=args.ppo_epochs, minibatches=args.minibatches,
                                     rollout_micro_batch_size=args.rollout_micro_batch_size),
            "DPPOArgs": dppo_args(mode, args),
        }
        source = _source(args, arch=arch, seed=seed, heldout=False)
        heldout = _source(args, arch=arch, seed=seed, heldout=True)
        objective = build_objective(configs=configs, arch=arch, policy=policy, reference=reference, source=source)
        skip_zero = args.skip_zero_advantage and args.kl_beta == 0
        if mode == "filter":
            objective.pruner = ZeroVarianceFilter(skip_zero=skip_zero)
        elif mode == "cppo":
            objective.pruner = SmallestAdvantageDrop(args.completion_rate, skip_zero=skip_zero)
        cum = 0.0
        records_eval0 = {"step": -1, "cum_time_s": 0.0, "time_s": 0.0, "train_tokens": 0.0, "rollout_tokens": 0.0,
                         "density": None, "beyond_steps": False, "seed": seed}
        if not warmup:
            records_eval0["heldout_reward"] = heldout_reward(objective, heldout, args)
        for step in range(max_steps):
            extra: dict = {}
            if args.grad_variance and mode not in ("grpo", "grpo_shared") and step % args.grad_variance_every == 0:
                extra.update(gradient_variance(objective, rule=objective.pruner, step=step, draws=args.grad_variance))
            for chunk in policy:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            acc.synchronize()  # on a GPU the clock reads after the queued kernels ran, not when they were queued
            start = time.perf_counter()
            m = objective.train_step(step)
            acc.synchronize()
            before_opt = time.perf_counter()
            _, grad_norm, _ = optimizer.step()
            acc.synchronize()
            end = time.perf_counter()
            elapsed = end - start
            cum += elapsed
            weights = [it.weight for mb in objective.buffer.minibatches for it in mb]
            rec = {
                "step": step, "seed": seed, "time_s": elapsed, "cum_time_s": cum,
                "rollout_time_s": m["rollout_time_s"], "reference_time_s": m["reference_time_s"],
                "old_logprob_time_s": m["old_logprob_time_s"],
                "update_time_s": m["train_time_s"] - m["old_logprob_time_s"],
                "optimizer_time_s": end - before_opt,
                "train_tokens": m["policy_tokens"], "rollout_tokens": m["rollout_tokens"], "density": m["density"],
                "kept_prompt_fraction": m["kept_prompt_fraction"],
                "kept_completion_fraction": m["kept_completion_fraction"],
                "weight_max": max(weights, default=0.0), "weight_mean": sum(weights) / max(len(weights), 1),
                "kept_reward_mean": m["reward_mean"], "zero_variance_groups": m["zero_variance_groups"],
                "loss": m["loss"], "grad_norm": grad_norm, "beyond_steps": step >= args.steps, **extra,
            }
            last = step == max_steps - 1 or (budget_s is not None and step >= args.steps - 1 and cum >= budget_s)
            if not warmup and ((step + 1) % args.eval_every == 0 or last or step == args.steps - 1):
                rec["heldout_reward"] = heldout_reward(objective, heldout, args)
            records.append(rec)
            if last:
                break
        records.insert(0, records_eval0)
    return records


def run_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_prune.accelerator import get_accelerator, set_accelerator
    from megatron_prune.training.parallel import initialize_distributed

    set_accelerator(args.device)
    torch.set_num_threads(args.threads)
    initialize_distributed(timeout_minutes=30)
    seeds = [int(x) for x in args.worker_seeds.split(",")]
    acc = get_accelerator()
    out = {"records": {m: [] for m in args.modes},
           "device_name": torch.cuda.get_device_name() if acc.kind == "cuda" else platform.processor(),
           "dppo_config": repr(dppo_args("dppo", args).dppo_config(kl_beta=args.kl_beta))}
    for mode in args.modes:  # each mode's first-call costs (its own code paths and shapes), discarded
        run_mode(mode, args, seed=seeds[0], budget_s=None, warmup=True)
    for seed, mode in ((s, m) for s in seeds for m in args.modes):
        budget = None
        if mode != "grpo" and args.match_time and out["records"]["grpo"]:
            budget = out["records"]["grpo"][-1]["cum_time_s"]
        t = time.perf_counter()
        recs = run_mode(mode, args, seed=seed, budget_s=budget)
        for r in recs:
            r["round"] = args.worker_round
        out["records"][mode].extend(recs)
        if dist.get_rank() == 0:
            print(f"[bench_grpo] seed {seed} round {args.worker_round} {mode}: {len(recs) - 1} steps, train "
                  f"{recs[-1]['cum_time_s']:.1f}s, held-out {recs[-1].get('heldout_reward', float('nan')):.3f} "
                  f"({time.perf_counter() - t:.0f}s with evaluation)", flush=True)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------- parent
def launch(args, argv: list[str], *, seeds: list[int], rnd: int, out_path: str) -> None:
    here = os.path.abspath(__file__)
    worker = [here, *argv, "--worker-seeds", ",".join(map(str, seeds)), "--worker-round", str(rnd),
              "--worker-out", out_path]
    nproc = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *worker]
    else:
        cmd = [sys.executable, *worker]
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    if nproc == 1:  # one process: initialize_distributed uses an in-process store, no port to collide on
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    print(f"[bench_grpo] seeds {seeds} round {rnd}: {' '.join(cmd[:6])} ...", flush=True)
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env)


def _heldout_at(records: list[dict], *, time_s: float | None = None, step: int | None = None) -> float | None:
    """Held-out reward at training time ``time_s`` (linear between evaluations; the last value after
    the run's end) or at the evaluation after ``step``."""
    evals = [r for r in records if "heldout_reward" in r]
    if not evals:
        return None
    if step is not None:
        hits = [r for r in evals if r["step"] == step]
        return hits[0]["heldout_reward"] if hits else None
    for a, b in zip(evals, evals[1:]):
        if a["cum_time_s"] <= time_s <= b["cum_time_s"]:
            span = b["cum_time_s"] - a["cum_time_s"]
            f = (time_s - a["cum_time_s"]) / span if span else 1.0
            return a["heldout_reward"] + f * (b["heldout_reward"] - a["heldout_reward"])
    return evals[-1]["heldout_reward"] if time_s >= evals[-1]["cum_time_s"] else evals[0]["heldout_reward"]


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _std(values):
    values = [v for v in values if v is not None]
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(records: dict[str, list[dict]], args) -> dict:
    """Per-mode summary (records: mode -> step records of every seed and round)."""
    seeds = sorted({r["seed"] for recs in records.values() for r in recs})
    rounds = sorted({r.get("round", 0) for recs in records.values() for r in recs})

    def runs(mode):
        return [[r for r in records[mode] if r["seed"] == s and r.get("round", 0) == k] for s in seeds for k in rounds]

    def timed(mode):  # steps within --steps (equal-steps statistics)
        return [r for r in records[mode] if r["step"] >= 0 and not r.get("beyond_steps")]

    # GRPO's training time of each (seed, round): modes are compared at the time GRPO needed for its
    # final step in the same worker process (same seed, same stretch of machine load)
    grpo_time = {(run[-1]["seed"], run[-1].get("round", 0)): run[-1]["cum_time_s"] for run in runs("grpo") if run}
    base_step = statistics.median(r["time_s"] for r in timed("grpo")) if timed("grpo") else None
    out = {}
    for mode in records:
        steps = timed(mode)
        if not steps:
            continue
        median_step = statistics.median(r["time_s"] for r in steps)
        finals = [next((r["heldout_reward"] for r in reversed(run) if "heldout_reward" in r), None)
                  for run in runs(mode) if run]
        at_time = [_heldout_at(run, time_s=grpo_time[(run[-1]["seed"], run[-1].get("round", 0))])
                   for run in runs(mode) if run and (run[-1]["seed"], run[-1].get("round", 0)) in grpo_time]
        at_steps = [_heldout_at(run, step=args.steps - 1) for run in runs(mode) if run]
        s = {
            "speedup_vs_grpo": base_step / median_step if base_step else None,
            "step_time_s": median_step,
            "heldout_reward_final": _mean(finals), "heldout_reward_final_std": _std(finals),
            "heldout_reward_at_grpo_time": _mean(at_time), "heldout_reward_at_grpo_time_std": _std(at_time),
            "heldout_reward_at_grpo_steps": _mean(at_steps), "heldout_reward_at_grpo_steps_std": _std(at_steps),
            "heldout_reward_at_grpo_time_by_seed": at_time, "heldout_reward_at_grpo_steps_by_seed": at_steps,
            "steps_run_mean": _mean([len([r for r in run if r["step"] >= 0]) for run in runs(mode) if run]),
        }
        for key in (*PHASES, "train_tokens", "rollout_tokens", "density", "kept_prompt_fraction",
                    "kept_completion_fraction", "weight_max", "weight_mean", "zero_variance_groups"):
            s[key] = _mean([r.get(key) for r in steps])
        s["weight_max_max"] = max(r["weight_max"] for r in steps)
        for key in ("grad_rel_mse", "grad_rel_bias"):
            vals = [r[key] for r in records[mode] if key in r]
            if vals:
                s[key] = _mean(vals)
        s["records"] = records[mode]
        out[mode] = s
    if "grpo" in out:
        for mode, s in out.items():
            for key in ("train_tokens", "rollout_tokens"):
                base = out["grpo"][key]
                s[f"{key}_vs_grpo"] = s[key] / base if base else None
    return out


def table(modes: dict) -> str:
    cols = [("speedup", "speedup_vs_grpo", "{:.2f}x"), ("step s", "step_time_s", "{:.3f}"),
            ("rollout s", "rollout_time_s", "{:.3f}"), ("train s", "update_time_s", "{:.3f}"),
            ("roll tok", "rollout_tokens_vs_grpo", "{:.2f}"), ("train tok", "train_tokens_vs_grpo", "{:.2f}"),
            ("density", "density", "{:.2f}"), ("w max", "weight_max_max", "{:.1f}"),
            ("@steps", "heldout_reward_at_grpo_steps", "{:.3f}"), ("@time", "heldout_reward_at_grpo_time", "{:.3f}"),
            ("final", "heldout_reward_final", "{:.3f}"), ("gvar", "grad_rel_mse", "{:.2f}")]
    lines = [f"{'mode':<16}" + "".join(f"{c[0]:>11}" for c in cols)]
    for mode, s in modes.items():
        cells = []
        for _, key, fmt in cols:
            v = s.get(key)
            cells.append(f"{fmt.format(v) if isinstance(v, (int, float)) else 'n/a':>11}")
        lines.append(f"{mode:<16}" + "".join(cells))
    return "\n".join(lines)


def _runs_of(records: list[dict]) -> dict[tuple[int, int], list[dict]]:
    runs: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        runs.setdefault((r["seed"], r.get("round", 0)), []).append(r)
    return runs


def plot(modes: dict, path: str, title: str) -> None:
    """Three panels of held-out reward (mean over seeds; band: min-max): against cumulative training
    wall-clock, against training time as a fraction of GRPO's with the same seed (the load of the
    machine cancels), and against training steps. A curve stops where its shortest run ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grpo_time = {key: run[-1]["cum_time_s"] for key, run in _runs_of(modes["grpo"]["records"]).items()} \
        if "grpo" in modes else {}

    def x_time(key, r):
        return r["cum_time_s"]

    def x_frac(key, r):
        return r["cum_time_s"] / grpo_time[key] if grpo_time.get(key) else None

    def x_step(key, r):
        return r["step"] + 1

    panels = [(x_time, "cumulative training wall-clock (s; evaluation excluded)"),
              (x_frac, "training time / GRPO's final training time (same seed)"),
              (x_step, "training steps")]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, (xfun, label) in zip(axes, panels):
        for mode, s in modes.items():
            curves = []
            for key, run in _runs_of(s["records"]).items():
                pts = [(xfun(key, r), r["heldout_reward"]) for r in run if "heldout_reward" in r]
                if pts and all(x is not None for x, _ in pts):
                    curves.append(pts)
            if not curves:
                continue
            end = min(c[-1][0] for c in curves)
            grid = [end * k / 100 for k in range(101)]

            def at(c, x):
                for (x0, y0), (x1, y1) in zip(c, c[1:]):
                    if x0 <= x <= x1:
                        return y0 + ((x - x0) / (x1 - x0) if x1 > x0 else 1.0) * (y1 - y0)
                return c[-1][1] if x >= c[-1][0] else c[0][1]

            vals = [[at(c, x) for c in curves] for x in grid]
            (line,) = ax.plot(grid, [sum(v) / len(v) for v in vals], label=f"{mode} ({len(curves)} runs)")
            ax.fill_between(grid, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.12)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out reward (mean; band: min-max over seeds)")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker_out:
        run_worker(args)
        return {}
    from megatron_prune.arguments import exit_without_device

    exit_without_device("bench_grpo.py", args.device)
    worker_argv = [a for a in argv]
    for flag in ("--json", "--plot"):
        if flag in worker_argv:
            i = worker_argv.index(flag)
            del worker_argv[i : i + 2]
    seeds = [args.seed + k for k in range(args.seeds)]
    chunks = [seeds[k : k + args.seeds_per_process] for k in range(0, len(seeds), args.seeds_per_process)]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    config = {k: v for k, v in vars(args).items() if not k.startswith("worker") and k != "earlier"}
    config.update(host=platform.node(), cpus=os.cpu_count(), python=platform.python_version(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg_start=load,
                  command=" ".join(["python", "tools/bench_grpo.py", *argv]))
    result: dict = {"config": config, "modes": {}}
    records: dict[str, list[dict]] = {m: [] for m in args.modes}
    if args.from_json:
        config, records = args.earlier
        result["config"] = config
        args.steps = config["steps"]
        result["modes"] = summarise(records, args)
        chunks = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds if chunks else 0):
            for chunk in chunks:
                out = os.path.join(tmp, f"{rnd}-{chunk[0]}.json")
                t = time.perf_counter()
                try:
                    launch(args, worker_argv, seeds=chunk, rnd=rnd, out_path=out)
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                    print(f"[bench_grpo] seeds {chunk} round {rnd}: FAILED ({exc})", flush=True)
                    result.setdefault("failed", []).append({"seeds": chunk, "round": rnd, "error": str(exc)})
                    continue
                with open(out) as f:
                    raw = json.load(f)
                config["device_name"] = raw.get("device_name")
                config.setdefault("dppo_config", raw.get("dppo_config"))
                if config["dppo_config"] != raw.get("dppo_config"):
                    print(f"[bench_grpo] warning: the DPPO config changed between runs: {raw.get('dppo_config')}")
                for mode, recs in raw["records"].items():
                    records[mode].extend(recs)
                print(f"[bench_grpo] seeds {chunk} round {rnd}: done in {time.perf_counter() - t:.0f}s", flush=True)
                result["modes"] = summarise({m: r for m, r in records.items() if r}, args)
                config["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
                if args.json:
                    _write_json(args.json, result)
    if result["modes"]:
        print(table(result["modes"]))
    if args.json:
        _write_json(args.json, result)
        print(f"[bench_grpo] wrote {args.json}")
    if args.plot and result["modes"]:
        plot(result["modes"], args.plot, f"GRPO vs DPPO, task {config['task']}, {config['seeds']} seeds x "
             f"{config['rounds']} rounds, lr {config['lr']:g}")
        print(f"[bench_grpo] wrote {args.plot}")
    if result.get("failed"):
        raise SystemExit(f"[bench_grpo] {len(result['failed'])} runs failed (their output is above)")
    return result


def _write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
