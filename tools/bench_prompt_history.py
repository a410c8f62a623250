"""How well DPPO's prompt history finds the prompts whose next group has unequal rewards.

A simulation, no model: a pool of prompts with pass rates ``x_i`` (drawn from
``Beta(--beta A B)``; U-shaped by default, as on math tasks where many prompts are always or never
solved; fixed unless ``--drift`` moves them), each step ``--batch`` prompts drawn from the pool, and the real prompt level of DPPO
(:class:`~megatron_prune.grpo.dppo.DPPOPruner`: keep probabilities from the history, keep draws,
history updates from the kept prompts' groups of ``--group-size`` pass/fail rewards). Every
prompt of the batch draws its group, kept or not, so the groups the prompt level pruned are known.

Per history score, and for two references (``uniform``: every prompt kept with ``1 - r``, no
history; ``oracle``: the score is the true ``P(group varies) = 1 - x^G - (1 - x)^G``):

* ``zero_var_kept``: fraction of the kept groups with equal rewards (no gradient without KL);
  ``zero_var_all`` is the same over the whole batch (what GRPO trains);
* ``recall``: the informative groups (unequal rewards) kept, over those in the batch;
* ``added_variance``: ``mean over informative groups of (1/p_i - 1)``, the relative variance the
  prompt level adds to a sum of equal-sized per-prompt gradients (Horvitz-Thompson; a group with
  equal rewards has zero gradient without KL, so its weight costs nothing). 0 = free pruning.

Steps before ``--warmup`` are left out of the figures (every prompt starts unseen, kept).

    python tools/bench_prompt_history.py --seeds 5 --steps 200
    python tools/bench_prompt_history.py --beta 2 8 --json /tmp/h.json   # pass rates near 0.2
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_prune.grpo.dppo import DPPOConfig, DPPOPruner, solve_keep_probs  # noqa: E402

SCORES = ("std", "informative", "pass-rate")
REFERENCES = ("uniform", "oracle")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n\n")
    from megatron_prune.arguments import ToolHelpFormatter

    p = argparse.ArgumentParser(description=summary, epilog=details, formatter_class=ToolHelpFormatter)
    p.add_argument("--pool", type=int, default=256, help="prompts in the pool")
    p.add_argument("--batch", type=int, default=64, help="prompts per step, drawn from the pool")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--steps", type=int, default=200, help="steps per seed")
    p.add_argument("--warmup", type=int, default=20, help="first steps left out of the figures")
    p.add_argument("--seeds", type=int, default=5, help="seeds (pass rates, batches, rewards and keep draws)")
    p.add_argument("--beta", type=float, nargs=2, default=(0.5, 0.5), metavar=("A", "B"),
                   help="pass rates x_i ~ Beta(A, B)")
    p.add_argument("--drift", type=float, default=0.0,
                   help="per-step change of every prompt's logit pass rate (a policy that learns)")
    p.add_argument("--prompt-rate", type=float, default=0.5, help="r_q")
    p.add_argument("--prompt-floor", type=float, default=0.3, help="smallest keep probability")
    p.add_argument("--history-decay", type=float, default=0.5, help="the history's decay")
    p.add_argument("--json", metavar="PATH", help="write the figures")
    args = p.parse_args(argv)
    for name in ("pool", "batch", "steps", "seeds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.group_size < 2:  # one completion is never a varied group: nothing would be informative
        p.error(f"--group-size must be >= 2, got {args.group_size}")
    if args.batch > args.pool:
        p.error(f"--batch {args.batch} is larger than --pool {args.pool}")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps}")
    if min(args.beta) <= 0:
        p.error("--beta A B must both be > 0")
    try:
        DPPOConfig(prompt_prune_rate=args.prompt_rate, prompt_floor=args.prompt_floor, history_decay=args.history_decay)
    except ValueError as exc:
        flags = {"prompt_prune_rate": "--prompt-rate", "prompt_floor": "--prompt-floor",
                 "history_decay": "--history-decay"}
        p.error(re.sub("|".join(flags), lambda m: flags[m.group(0)], str(exc)))
    return args


def simulate(args: argparse.Namespace, *, kind: str, seed: int) -> dict[str, float]:
    """One seed of one score kind (or reference): the figures averaged over the measured steps."""
    gen = torch.Generator().manual_seed(seed)  # batches and rewards: the same for every kind
    keep_gen = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)  # Beta.sample draws from the global generator
    logits = torch.distributions.Beta(*args.beta).sample((args.pool,)).clamp(1e-6, 1 - 1e-6).logit()
    pruner = None
    if kind in SCORES:
        config = DPPOConfig(prompt_prune_rate=args.prompt_rate, prompt_floor=args.prompt_floor,
                            history_decay=args.history_decay, history_score=kind)
        pruner = DPPOPruner(config=config, seed=seed)
    figures = {"zero_var_kept": [], "zero_var_all": [], "recall": [], "added_variance": [], "kept": []}
    for step in range(args.steps):
        ids = torch.randperm(args.pool, generator=gen)[: args.batch].tolist()
        rates = (logits[ids] + args.drift * step).sigmoid().double()
        draws = torch.rand(args.batch, args.group_size, generator=gen, dtype=torch.float64)
        rewards = (draws < rates[:, None]).double()
        informative = rewards.std(dim=1, correction=0) > 0
        if pruner is not None:
            decision = pruner.select_prompts(step=step, prompt_ids=ids)
            probs, keep = decision.probs, decision.keep
            pruner.observe(prompt_ids=[i for i, k in zip(ids, keep.tolist()) if k], rewards=rewards[keep])
        else:
            vary = 1 - rates ** args.group_size - (1 - rates) ** args.group_size
            scores = vary if kind == "oracle" else torch.ones_like(rates)
            probs = solve_keep_probs(scores, prune_rate=args.prompt_rate, floor=args.prompt_floor)
            keep = torch.rand(args.batch, generator=keep_gen, dtype=torch.float64) < probs
        if step < args.warmup:
            continue
        figures["kept"].append(keep.double().mean().item())
        figures["zero_var_all"].append(1 - informative.double().mean().item())
        if keep.any():
            figures["zero_var_kept"].append(1 - informative[keep].double().mean().item())
        if informative.any():
            figures["recall"].append((informative & keep).sum().item() / informative.sum().item())
            figures["added_variance"].append((1 / probs[informative] - 1).mean().item())
    # A figure of informative groups has no value where no measured group was informative.
    return {key: statistics.fmean(values) if values else math.nan for key, values in figures.items()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results: dict[str, dict] = {}
    for kind in (*REFERENCES, *SCORES):
        per_seed = [simulate(args, kind=kind, seed=1234 + s) for s in range(args.seeds)]
        results[kind] = {key: {"mean": statistics.fmean(r[key] for r in per_seed),
                               "stderr": (statistics.stdev(r[key] for r in per_seed) / len(per_seed) ** 0.5
                                          if len(per_seed) > 1 else 0.0)}
                         for key in per_seed[0]}
    columns = ("kept", "zero_var_all", "zero_var_kept", "recall", "added_variance")
    print(f"pass rates ~ Beta{tuple(args.beta)}, G = {args.group_size}, r_q = {args.prompt_rate}, floor "
          f"{args.prompt_floor}, decay {args.history_decay}, drift {args.drift}, {args.seeds} seeds x "
          f"{args.steps - args.warmup} steps (mean ± standard error over seeds)")
    print(f"{'score':<12}" + "".join(f"{c:>22}" for c in columns))
    for kind, figures in results.items():
        print(f"{kind:<12}" + "".join(f"{figures[c]['mean']:>14.3f} ± {figures[c]['stderr']:.3f}" for c in columns))
    out = {"config": vars(args), "scores": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
