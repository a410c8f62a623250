"""The objective's formula learns the toy task: GRPO with DPPO pruning, in a hand-written loop.

Rewards -> group advantages (full groups) -> prompt and completion pruning ->
importance-weighted ``grpo_loss`` with a constant normaliser, called here directly (not
through the trainer: its wiring is pinned by tests/distributed/test_grpo_objective.py, and
the trainer learning the toy task by the slow tests/e2e/test_grpo_cli.py run). This shows
the toy reward is dense enough to rise within a few dozen steps, with pruning on. The policy is a
small GRU language model (91k parameters) over the task's 512-token vocabulary; with
Adam at lr 3e-2 the mean reward goes from ~0.1 to above 0.7 in about 30 steps (at lr
1e-2 it barely moves in 40: the reward is dense, but each token's logit is learned from
its own samples, so the step size matters).
"""

from __future__ import annotations

import pytest
import torch

from megatron_prune.grpo.advantages import group_advantages
from megatron_prune.grpo.dppo import DPPOConfig, DPPOPruner, combine_weights
from megatron_prune.grpo.loss import GRPOLossConfig, grpo_loss
from megatron_prune.grpo.rewards import ToyTask, ToyTaskConfig


class TinyLM(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden)
        self.rnn = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor | None = None):
        output, state = self.rnn(self.embed(tokens), state)
        return torch.log_softmax(self.head(output), dim=-1), state


@torch.no_grad()
def rollout(model: TinyLM, prompts: torch.Tensor, *, length: int, generator: torch.Generator) -> torch.Tensor:
    logprobs, state = model(prompts)
    tokens = []
    for _ in range(length):
        token = torch.multinomial(logprobs[:, -1].exp(), 1, generator=generator)
        tokens.append(token)
        logprobs, state = model(token, state)
    return torch.cat(tokens, dim=1)


def completion_logprobs(model: TinyLM, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    logprobs, _ = model(torch.cat([prompts, completions], dim=1))
    predicted = logprobs[:, prompts.shape[1] - 1 : -1]
    return predicted.gather(-1, completions[..., None])[..., 0]


@pytest.fixture
def one_thread():
    """The policy is tiny: one thread is ~10x faster than contended intra-op parallelism."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("binary", [False, True], ids=["toy", "toy-binary"])
def test_grpo_with_dppo_learns_the_toy_task(one_thread, binary):
    """Both toy rewards: the fractional one, and the binary one (1 when the first answer token is
    in the class), whose groups are often all-wrong at first: it still has signal from step one."""
    torch.manual_seed(0)
    task = ToyTask(ToyTaskConfig(binary=binary))
    model = TinyLM(task.config.vocab_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    pruner = DPPOPruner(config=DPPOConfig(prompt_prune_rate=0.25, completion_prune_rate=0.5), seed=0)
    generator = torch.Generator().manual_seed(0)
    num_prompts, group, length, pool = 16, 8, 8, 64
    mean_rewards, pruned_fractions = [], []
    for step in range(40):
        start = (step * num_prompts) % pool
        prompts = task.prompts(num_prompts, start=start)
        prompt_ids = [p.index for p in prompts]
        prompt_decision = pruner.select_prompts(step=step, prompt_ids=prompt_ids)
        kept = [p for p, keep in zip(prompts, prompt_decision.keep.tolist()) if keep]
        prompt_tokens = torch.tensor([p.token_ids for p in kept]).repeat_interleave(group, dim=0)
        completions = rollout(model, prompt_tokens, length=length, generator=generator)
        rewards = torch.tensor(
            [task.score_tokens(c.tolist(), target_digit=p.target_digit)
             for p, c in zip([p for p in kept for _ in range(group)], completions)]
        ).reshape(len(kept), group)
        advantages = group_advantages(rewards)  # on the full groups
        decision = pruner.select_completions(step=step, prompt_ids=[p.index for p in kept], advantages=advantages)
        weights = combine_weights(
            prompt_weights=prompt_decision.weights[prompt_decision.keep], completion_weights=decision.weights
        )
        rows = decision.keep.flatten()
        old = completion_logprobs(model, prompt_tokens[rows], completions[rows]).detach()
        loss, _ = grpo_loss(
            logprobs=completion_logprobs(model, prompt_tokens[rows], completions[rows]),
            old_logprobs=old,
            advantages=advantages.flatten()[rows],
            mask=torch.ones_like(old, dtype=torch.bool),
            weights=weights.flatten()[rows],
            normaliser=num_prompts * group * length,  # constant: valid under prompt pruning
            config=GRPOLossConfig(clip_eps_high=0.28),
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        pruner.observe(prompt_ids=[p.index for p in kept], rewards=rewards)
        mean_rewards.append(rewards.mean().item())
        pruned_fractions.append(1 - rows.double().sum().item() / (num_prompts * group))
    print([round(r, 2) for r in mean_rewards], sum(pruned_fractions) / len(pruned_fractions))
    assert sum(mean_rewards[:3]) / 3 < 0.2
    assert sum(mean_rewards[-5:]) / 5 > 0.5, mean_rewards
    assert sum(pruned_fractions) / len(pruned_fractions) > 0.3, pruned_fractions
