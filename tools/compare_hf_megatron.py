r"""Check a Megatron checkpoint against its HF model: same tokens, compare the logits.

    torchrun --nproc-per-node N*M tools/compare_hf_megatron.py --hf-dir HF --load OUT \
        --tensor-model-parallel-size N --pipeline-model-parallel-size M [--tolerance 1e-4] [--seq-length 32] \
        [--virtual-pipeline-model-parallel-size V] [--expert-model-parallel-size E]

Runs the Megatron model at the given layout (fp32) and transformers' model of HF (fp32, on
rank 0) on the same random tokens; prints max |delta logits|, mean |delta logits|,
KL(HF || Megatron) and top-1 / top-5 agreement over the true vocabulary. Exit code 1 when max
|delta logits| exceeds --tolerance, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_prune.arguments import ToolHelpFormatter, at_least

    p = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model directory")
    p.add_argument("--load", required=True, help="Megatron checkpoint (save root or iter_* directory)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP of the Megatron model")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP of the Megatron model")
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved schedule; needs PP > 1): the "
                        "--batch-size rows run as one-row microbatches, padded to a multiple of PP")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert-parallel ranks of a Qwen3-MoE model (must divide the data-parallel size); "
                        "a MoE model at TP > 1 runs with sequence parallelism")
    p.add_argument("--tolerance", type=at_least(0.0, float), default=1e-4, help="largest accepted max |delta logits|")
    p.add_argument("--seq-length", type=int, default=32, help="tokens per compared sequence")
    p.add_argument("--batch-size", type=int, default=2, help="random sequences compared")
    p.add_argument("--seed", type=int, default=0, help="seed of the random test tokens")
    p.add_argument("--hf-device", default="cpu", help="device of the HF reference model (rank 0): cpu, cuda, cuda:N")
    args = p.parse_args(argv)
    for flag in ("seq_length", "batch_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_prune.arguments import exit_without_device

    exit_without_device("compare_hf_megatron.py", "cuda" if args.hf_device.startswith("cuda") else None,
                        flag="--hf-device")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron_prune.model.hf_convert import compare_hf_and_megatron, read_hf_arch
    from megatron_prune.training.checkpoint import CheckpointError

    try:
        arch = read_hf_arch(args.hf_dir)
        chunks = args.pipeline_model_parallel_size * (args.virtual_pipeline_model_parallel_size or 1)
        if arch.num_layers % chunks:
            raise ValueError(f"the model's {arch.num_layers} layers do not split into --pipeline-model-parallel-size x "
                             f"--virtual-pipeline-model-parallel-size = {chunks} equal model chunks")
        from megatron_prune.model.provider import ParallelConfig
        from megatron_prune.training.parallel import initialize_distributed, validate_layout
        from megatron_prune.training.session import check_layout_fits

        parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                  virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                                  expert_model_parallel_size=args.expert_model_parallel_size,
                                  sequence_parallel=arch.is_moe and args.tensor_model_parallel_size > 1)
        validate_layout(parallel, int(os.environ.get("WORLD_SIZE", "1")), dry_run_hint=False)
        check_layout_fits(arch, parallel)
        initialize_distributed()
        result = compare_hf_and_megatron(hf_dir=args.hf_dir, load_dir=args.load, parallel=parallel,
                                         seq_length=args.seq_length, batch_size=args.batch_size,
                                         seed=args.seed, hf_device=args.hf_device)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        from megatron_prune.training.session import fail_usage

        fail_usage(exc)
    import torch.distributed as dist

    ok = result.ok(args.tolerance)
    if not dist.is_initialized() or dist.get_rank() == 0:
        layout = f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size}"
        if args.virtual_pipeline_model_parallel_size:
            layout += f" VPP={args.virtual_pipeline_model_parallel_size}"
        if args.expert_model_parallel_size > 1:
            layout += f" EP={args.expert_model_parallel_size}"
        print(f"{layout}: {result.summary()}")
        print("OK" if ok else f"FAIL: max |dlogits| {result.max_abs_diff:.3e} > tolerance {args.tolerance:.1e}")
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    from megatron_prune.training.parallel import shutdown_distributed

    shutdown_distributed()  # every rank returned: leave no gloo group to interpreter teardown
    sys.exit(code)
