"""Peak memory and time of three LM-head paths, forward + backward, at a Qwen3-sized vocabulary.

Methods (all end in the mean log-prob of the labels at the scored positions, then ``backward``):

- ``full``       Megatron-style: logits of every position ``[T, V]``, then cross entropy on the
                 scored positions (what GPTModel + a loss mask costs);
- ``selective``  index the scored rows first, then full logits of those rows ``[n, V]`` + CE;
- ``fused``      index the scored rows, then ``megatron_prune.ops.vocab_parallel_logprobs``
                 (chunked over the vocabulary, logits recomputed in backward).

Every (sequence length, method) runs in a fresh subprocess so that the peak is clean. Memory is
the peak above the baseline after set-up (hidden, weight, labels allocated and a tiny warm-up run
done): the allocator peak on GPU/NPU, peak RSS (VmHWM, reset through /proc/self/clear_refs) on
CPU. All three paths allocate the ``[V, h]`` weight gradient; it is included in the peak.

    python tools/bench_selective_head.py                       # CPU default, ~3 min on 2 cores
    python tools/bench_selective_head.py --seq-lens 512 2048 4096 --json bench.json
    python tools/bench_selective_head.py --device cuda --seq-lens 4096 8192 16384
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

METHODS = ("full", "selective", "fused")
QWEN3_VOCAB = 151936


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_prune.arguments import ToolHelpFormatter, at_least, finite_float

    p = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "npu", "cpu"), help="where the head runs")
    p.add_argument("--vocab-size", type=at_least(1), default=QWEN3_VOCAB, help="vocabulary (default: Qwen3's)")
    p.add_argument("--hidden-size", type=at_least(1), default=1024, help="hidden size h of the head's input")
    p.add_argument(
        "--seq-lens", type=at_least(1), nargs="+", default=None,
        help="positions T per run (default: 256 512 1024 on CPU, 2048 4096 8192 on GPU/NPU)",
    )
    p.add_argument("--scored-fraction", type=finite_float, default=0.5, help="fraction of positions scored")
    p.add_argument("--chunk-size", type=at_least(1), default=4096, help="vocabulary rows per block of the fused op")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: float32 on CPU, bfloat16 on GPU/NPU")
    p.add_argument("--iters", type=at_least(1), default=1, help="timed forward+backward iterations per run")
    p.add_argument("--seed", type=int, default=0, help="seed of the random hidden states and labels")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--worker-seq-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 < args.scored_fraction <= 1:
        p.error(f"--scored-fraction must be in (0, 1], got {args.scored_fraction}")
    from megatron_prune.arguments import refuse_unwritable_outputs

    refuse_unwritable_outputs(p, json=args.json)  # before the runs, not after them
    return args


# ----------------------------------------------------------------------------- worker side


def head_loss(method: str, hidden, weight, labels, scored, *, chunk_size: int) -> torch.Tensor:
    """Mean label log-prob at the scored positions, by ``method``."""
    if method == "full":
        logits = hidden @ weight.t()
        return -F.cross_entropy(logits[scored].float(), labels[scored])
    if method == "selective":
        logits = hidden[scored] @ weight.t()
        return -F.cross_entropy(logits.float(), labels[scored])
    from megatron_prune.ops import vocab_parallel_logprobs

    return vocab_parallel_logprobs(hidden[scored], weight, labels[scored], chunk_size=chunk_size).mean()


def make_problem(*, seq_len: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(args.seed)
    h, v = args.hidden_size, args.vocab_size
    hidden = torch.randn(seq_len, h, generator=g).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device, dtype).requires_grad_(True)
    labels = torch.randint(0, v, (seq_len,), generator=g).to(device)
    n = max(1, round(args.scored_fraction * seq_len))
    scored = torch.randperm(seq_len, generator=g)[:n].sort().values.to(device)
    return hidden, weight, labels, scored


def run_worker(args: argparse.Namespace) -> dict:
    from megatron_prune.adapters.mindspeed import bootstrap_device  # prepares MindSpeed for --device npu
    from megatron_prune.accelerator import get_accelerator

    bootstrap_device(["--device", args.device])
    acc = get_accelerator()
    hidden, weight, labels, scored = make_problem(
        seq_len=args.worker_seq_len, args=args, device=acc.device, dtype=getattr(torch, args.dtype)
    )

    def step(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        return head_loss(args.worker, rows, weight, labels[:n], positions, chunk_size=args.chunk_size)

    warm = hidden[:16].detach().requires_grad_(True)  # load kernels / libraries on a tiny problem
    step(warm, torch.arange(0, warm.shape[0], 2, device=acc.device)).backward()
    del warm
    weight.grad = None
    acc.synchronize()
    acc.release_cached_memory()
    acc.reset_peak_memory()
    baseline = acc.current_memory_bytes()
    seconds = []
    for _ in range(args.iters):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        loss = step(hidden, scored)
        loss.backward()
        acc.synchronize()
        seconds.append(time.perf_counter() - start)
    return {
        "method": args.worker,
        "seq_len": args.worker_seq_len,
        "scored": int(scored.numel()),
        "peak_bytes": acc.peak_memory_bytes() - baseline,
        "seconds": min(seconds),
        "loss": float(loss.detach()),
        "weight_grad_bytes": weight.grad.numel() * weight.grad.element_size(),
    }


# ----------------------------------------------------------------------------- driver side


def worker_argv(args: argparse.Namespace, *, method: str, seq_len: int) -> list[str]:
    """The command-line of one (method, seq_len) run, from the parsed driver arguments."""
    return [
        "--device", args.device, "--dtype", args.dtype, "--vocab-size", str(args.vocab_size),
        "--hidden-size", str(args.hidden_size), "--scored-fraction", str(args.scored_fraction),
        "--chunk-size", str(args.chunk_size), "--iters", str(args.iters), "--seed", str(args.seed),
        "--worker", method, "--worker-seq-len", str(seq_len),
    ]


def run_one(args: argparse.Namespace, *, method: str, seq_len: int) -> dict:
    cmd = [sys.executable, __file__, *worker_argv(args, method=method, seq_len=seq_len)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{method} at T={seq_len} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_ratios(rows: list[dict]) -> None:
    full = {r["seq_len"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        base = full[r["seq_len"]]
        r["peak_vs_full"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_vs_full"] = r["seconds"] / base["seconds"]
        r["loss_diff_vs_full"] = abs(r["loss"] - base["loss"])


def format_table(rows: list[dict]) -> str:
    mib = 2**20
    head = (
        f"{'T':>6} {'scored':>6} {'method':>9} {'peak MiB':>9} {'x full':>7} "
        f"{'time s':>8} {'x full':>7} {'|dloss|':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['seq_len']:>6} {r['scored']:>6} {r['method']:>9} {r['peak_bytes'] / mib:>9.0f} "
            f"{r['peak_vs_full']:>7.3f} {r['seconds']:>8.2f} {r['time_vs_full']:>7.3f} "
            f"{r['loss_diff_vs_full']:>8.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megatron_prune.accelerator import AcceleratorError, detect_kind

    try:
        kind = args.device = detect_kind(args.device)
    except AcceleratorError as exc:
        raise SystemExit(f"bench_selective_head.py: error: {exc}") from None
    args.dtype = args.dtype or ("float32" if kind == "cpu" else "bfloat16")
    if args.worker:
        print(json.dumps(run_worker(args)))
        return
    seq_lens = args.seq_lens or ([256, 512, 1024] if kind == "cpu" else [2048, 4096, 8192])
    meta = {
        "device": kind, "dtype": args.dtype, "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
        "scored_fraction": args.scored_fraction, "chunk_size": args.chunk_size, "iters": args.iters,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
    }
    print(f"# {json.dumps(meta)}", flush=True)
    rows = []
    for seq_len in seq_lens:
        for method in METHODS:
            rows.append(run_one(args, method=method, seq_len=seq_len))
            print(f"#   T={seq_len} {method}: {rows[-1]['seconds']:.2f} s", flush=True)
    add_ratios(rows)
    print(format_table(rows))
    print(f"(peaks include the [V, h] weight gradient: {rows[0]['weight_grad_bytes'] / 2**20:.0f} MiB)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)  # a folder the probe may have left out
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
