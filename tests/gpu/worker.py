"""One DPO case on one device, in a process of its own; used by ``test_gpu_parity``.

    python -m tests.gpu.worker --device cuda --out /tmp/cuda.pt

Runs every case of :data:`CASES` through ``DPOStep`` (the trainer's step: reference pass, pruned
branch, policy forward-backward) on a single rank and saves each case's metrics and whole
gradients, on the CPU, with ``torch.save``. The weights come from the layout- and
device-independent initialisation, and the pruning draws from CPU generators, so a CUDA run and a
CPU run of the same case compute the same objective.
"""

from __future__ import annotations

import argparse

import torch

CASES: dict[str, dict] = {
    "concat": dict(layout="concat"),
    "concat_full_head": dict(layout="concat", prune=dict(selective_head=False)),
    "full": dict(layout="full"),
    "concat_packed": dict(layout="concat", pack_rows=True),
    "position_branch": dict(layout="concat", prune=dict(position_ratio=0.6, branch=True)),
    "all": dict(layout="concat", prune=dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True)),
    "shared": dict(layout="shared"),
    "shared_all": dict(layout="shared", prune=dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True)),
    "shared_all_packed": dict(layout="shared", pack_rows=True,
                              prune=dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True)),
}


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES))
    args = p.parse_args(argv)

    from megatron_prune.accelerator import set_accelerator
    from megatron_prune.training.parallel import initialize_distributed
    from tests.distributed.dpo_harness import dpo_grads

    set_accelerator(args.device)
    initialize_distributed()
    if args.device == "cuda":  # fp32 compared with fp32: no TF32 in the matrix products
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results = {}
    for name in args.cases:
        out = dpo_grads(**CASES[name])
        results[name] = dict(metrics=_to_cpu(out["metrics"]), counters=_to_cpu(out["counters"]),
                             grads=_to_cpu(out["grads"]))
    torch.save(results, args.out)


if __name__ == "__main__":
    main()
