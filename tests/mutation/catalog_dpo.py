"""Seeded bugs of the DPO objective as the trainer computes it, each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

OBJECTIVE = "tests/distributed/test_dpo_objective.py"
REFERENCE = f"{OBJECTIVE}::test_pruning_off_equals_independent_reference"
BRANCH = f"{OBJECTIVE}::test_branch_pruning_is_unbiased_through_the_step"
POSITION = f"{OBJECTIVE}::test_position_pruning_reward_estimate_is_unbiased_through_the_step"
STRUCTURE = f"{OBJECTIVE}::test_branch_pruning_saves_compute_by_structure"
BRANCH_RATE = f"{OBJECTIVE}::test_branch_draw_keeps_chosen_at_rate_q"
LOSS_UNIT = "tests/unit/test_dpo_loss.py"

MUTANTS: list[dict] = [
    {
        "name": "dpo-margin-sign",
        "why": "the margin is taken as rejected minus chosen: DPO trains the policy towards the rejected answers",
        "file": "megatron_prune/dpo/loss.py",
        "old": "margin = beta * (chosen - rejected)",
        "new": "margin = beta * (rejected - chosen)",
        "tests": [LOSS_UNIT, REFERENCE],
    },
    {
        "name": "dpo-beta-dropped",
        "why": "the margin ignores beta (the --dpo-beta flag has no effect)",
        "file": "megatron_prune/dpo/loss.py",
        "old": "margin = beta * (chosen - rejected)",
        "new": "margin = chosen - rejected",
        "tests": [LOSS_UNIT, REFERENCE],
    },
    {
        "name": "dpo-position-off-drops-last-token",
        "why": "with position pruning off, the last response token is never scored",
        "file": "megatron_prune/sampling.py",
        "old": "    if ratio >= 1.0:\n        return torch.arange(length)",
        "new": "    if ratio >= 1.0:\n        return torch.arange(max(1, length - 1))",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-sequence-off-drops-last-token",
        "why": "with sequence pruning off, every response loses its last token",
        "file": "megatron_prune/sampling.py",
        "old": "    if min_ratio >= 1.0 or length <= 1:\n        return length",
        "new": "    if min_ratio >= 1.0 or length <= 1:\n        return max(1, length - 1)",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-scored-position-shift",
        "why": "scored positions are off by one: each response token is read at its own position, not the one predicting it",
        "file": "megatron_prune/dpo/batch.py",
        "old": "positions = start + len(plan.prompt) + scored - 1",
        "new": "positions = start + len(plan.prompt) + scored",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-loss-summed-over-pairs",
        "why": "the microbatch loss sums the pair losses: the gradient grows with the micro-batch size",
        "file": "megatron_prune/dpo/step.py",
        "old": "        loss = losses.mean()\n",
        "new": "        loss = losses.sum()\n",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-reference-from-policy",
        "why": "the reference log-probs come from the policy, so every log-ratio is 0",
        "file": "megatron_prune/dpo/step.py",
        "old": "outputs = self._forward_only(self.reference, batches, seq_length)",
        "new": "outputs = self._forward_only(self.policy, batches, seq_length)",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-mean-divides-by-length",
        "why": "the mean log-ratio divides by the response length instead of the scored positions (biased under position pruning)",
        "file": "megatron_prune/dpo/loss.py",
        "old": "        coef = 1.0 / num_scored_t\n",
        "new": "        coef = 1.0 / torch.tensor(lengths, dtype=torch.float32)\n",
        "tests": [POSITION],
    },
    {
        "name": "dpo-sum-not-rescaled",
        "why": "the summed log-ratio is not rescaled by T/|S| under position pruning (biased towards 0)",
        "file": "megatron_prune/dpo/loss.py",
        "old": "        coef = torch.tensor(lengths, dtype=torch.float32) / num_scored_t\n",
        "new": "        coef = torch.ones_like(num_scored_t)\n",
        "tests": [POSITION],
    },
    {
        "name": "dpo-training-pass-divisor",
        "why": "the training pass divides by the response length, not its scored positions",
        "file": "megatron_prune/dpo/step.py",
        "old": "num_scored=[r.num_scored for r in batch.responses], lengths=[r.length for r in batch.responses],",
        "new": "num_scored=[r.length for r in batch.responses], lengths=[r.length for r in batch.responses],",
        "tests": [POSITION],
    },
    {
        "name": "dpo-pruned-branch-divisor",
        "why": "the pruned branch's log-ratio divides by the response length, not its scored positions",
        "file": "megatron_prune/dpo/step.py",
        "old": "num_scored=[len(val)], lengths=[self._length(plans, key)],",
        "new": "num_scored=[self._length(plans, key)], lengths=[self._length(plans, key)],",
        "tests": [POSITION],
    },
    {
        "name": "dpo-branch-draw-inverted",
        "why": "the branch draw keeps chosen with probability 1 - q_w while the step weights it by 1/q_w",
        "file": "megatron_prune/sampling.py",
        "old": 'return uniform(seed, step, sample_id, "branch") < chosen_prob',
        "new": 'return uniform(seed, step, sample_id, "branch") >= chosen_prob',
        "tests": [BRANCH_RATE, BRANCH],
    },
    {
        "name": "dpo-kept-branch-scale",
        "why": "the kept branch is weighted 1/(1 - q_w) whichever branch it is (right only at q_w = 0.5)",
        "file": "megatron_prune/dpo/step.py",
        "old": "scales.append(1.0 / (q_w if plan.kept_branch == CHOSEN else 1.0 - q_w))",
        "new": "scales.append(1.0 / (1.0 - q_w))",
        "tests": [BRANCH],
    },
    {
        "name": "dpo-kept-branch-unscaled",
        "why": "the kept branch's gradient is not divided by its keep probability (half the expected gradient)",
        "file": "megatron_prune/dpo/step.py",
        "old": "            grad_scale = torch.tensor(scales, device=ratios.device)\n",
        "new": "            grad_scale = None\n",
        "tests": [BRANCH],
    },
    {
        "name": "dpo-pruned-branch-with-grad",
        "why": "the forward-only passes run with autograd on: the pruned branch keeps its activations (no memory saved)",
        "file": "megatron_prune/dpo/step.py",
        "old": "        with torch.no_grad():\n            outputs = run_schedule(",
        "new": "        with contextlib.nullcontext():\n            outputs = run_schedule(",
        "tests": [STRUCTURE],
    },
    {
        "name": "dpo-pruned-branch-in-training-pass",
        "why": "the training pass runs both branches again under branch pruning (same loss, the compute saving is lost)",
        "file": "megatron_prune/dpo/step.py",
        "old": "branches_of = (lambda p: [p.kept_branch]) if self.s.prune.branch else",
        "new": "branches_of = (lambda p: [CHOSEN, REJECTED]) if self.s.prune.branch else",
        "tests": [STRUCTURE],
    },
]
