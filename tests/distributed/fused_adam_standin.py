"""A CPU stand-in for Transformer Engine's and Apex's fused Adam, as far as checkpoints see it: the
step count lives in each param group (``group["step"]``, an int), not in each parameter's state,
and the per-parameter state holds only the two moments. Substituted where Megatron-Core picks its
Adam class, so the resume paths meet the layout a GPU with TE or Apex gives them."""

from __future__ import annotations

import torch

STEPS_USED: list[int] = []
"""The step each param group's update used for bias correction, in order."""


class GroupStepAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **_):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            assert isinstance(group["step"], int), "the fused kernels take the step as an int"
            STEPS_USED.append(group["step"])
            (beta1, beta2), t = group["betas"], group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
                p.add_(update + group["weight_decay"] * p, alpha=-group["lr"])


def install() -> None:
    import megatron.core.optimizer as optimizer

    optimizer.Adam = GroupStepAdam
    optimizer.USING_PYTORCH_OPTIMIZER = False
