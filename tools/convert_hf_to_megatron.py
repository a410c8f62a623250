"""Convert an HF model directory (Llama, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE; safetensors) to a Megatron checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir HF --save OUT [--dtype auto|fp32|bf16]

Writes OUT/iter_0000000 (dist checkpoint + meta.json with the architecture) and OUT/hf_assets
(config.json and tokenizer files). The trainers load OUT at any TP x PP x DP layout. Under
torchrun with --tensor/--pipeline-model-parallel-size each rank holds only its share of the
model while converting (for models larger than one process's memory). See docs/conversion.md.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_prune.arguments import ToolHelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--save", required=True, help="new directory for the Megatron checkpoint")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="parameter dtype of the checkpoint; auto: bf16 for a bf16 model, else fp32")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="layout to convert at (memory per rank only; the checkpoint loads at any layout)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages to convert at (the checkpoint loads at any layout)")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert-parallel ranks of a Qwen3-MoE model (must divide the data-parallel size); "
                        "a MoE model at TP > 1 runs with sequence parallelism")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_prune.arguments import tool_logging

    tool_logging()
    from megatron_prune.model.hf_convert import check_hf_weights, check_save_dir, convert_hf_to_megatron, read_hf_arch

    try:
        arch = read_hf_arch(args.hf_dir)  # refuse an unsupported model or unreadable weights before starting anything
        check_hf_weights(args.hf_dir, arch)
        check_save_dir(args.save)
        from megatron_prune.model.provider import ParallelConfig
        from megatron_prune.training.parallel import initialize_distributed, validate_layout
        from megatron_prune.training.session import check_layout_fits

        parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                  expert_model_parallel_size=args.expert_model_parallel_size,
                                  sequence_parallel=arch.is_moe and args.tensor_model_parallel_size > 1)
        validate_layout(parallel, int(os.environ.get("WORLD_SIZE", "1")), dry_run_hint=False)
        check_layout_fits(arch, parallel)
        initialize_distributed()
        path = convert_hf_to_megatron(hf_dir=args.hf_dir, save_dir=args.save, dtype=args.dtype, parallel=parallel)
    except (ValueError, FileNotFoundError) as exc:
        from megatron_prune.training.session import fail_usage

        fail_usage(exc)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    code = main()
    from megatron_prune.training.parallel import shutdown_distributed

    shutdown_distributed()  # every rank returned: leave no gloo group to interpreter teardown
    sys.exit(code)
