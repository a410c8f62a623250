"""Export a Megatron checkpoint (converted or trained) to an HF model directory.

    python tools/convert_megatron_to_hf.py --load OUT --hf-out HF2 [--dtype auto|fp32|bf16]
        [--max-shard-size 5GB] [--hf-assets DIR]
    python tools/convert_megatron_to_hf.py --load LORA_CKPT [--hf-out HF2 --merge-lora] [--peft-out DIR]
        [--base-hf DIR | --base-load DIR]

Reads the newest complete checkpoint under --load (saved at any layout), one layer at a time,
and writes config.json (the original one, with its dtype set), model.safetensors (sharded with
an index when larger than --max-shard-size) and the tokenizer files. The original config and
tokenizer come from --hf-assets, else from hf_assets/ next to the checkpoint (written by
convert_hf_to_megatron.py); without either a config.json is made from the recorded architecture.

A LoRA checkpoint holds the adapters alone and records its frozen base (the --hf-model directory,
the Megatron checkpoint given to --load, or the preset it was trained from); both LoRA exports
read the base from there, or from --base-hf DIR when an HF base has moved, or from --base-load DIR
when a Megatron base has moved (either must hold the same weights: the recorded fingerprint).
Under --merge-lora the base's config and tokenizer are the default assets (for a Megatron base:
the hf_assets/ kept next to it).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_prune.arguments import ToolHelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=ToolHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (a save root or one iter_* directory)")
    p.add_argument("--hf-out", default=None, help="new (or empty) directory for the HF model")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA checkpoint: write base weights with the adapters merged in (W + alpha/r * B A)")
    p.add_argument("--peft-out", default=None,
                   help="a LoRA checkpoint: write its adapters as a PEFT directory (adapter_config.json + "
                        "adapter_model.safetensors) for the HF base model")
    p.add_argument("--base-hf", default=None,
                   help="a LoRA checkpoint: the HF base model directory to use instead of the base the checkpoint "
                        "records (moved or copied; it must hold the same weights); with --peft-out it is written "
                        "as base_model_name_or_path")
    p.add_argument("--base-load", default=None,
                   help="a LoRA checkpoint trained on a Megatron checkpoint (a converted model or a full-parameter "
                        "training checkpoint) that has moved: the base checkpoint's new place (a save root or one "
                        "iter_* directory); it must hold the same weights")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="dtype of the written weights; auto keeps the checkpoint's")
    p.add_argument("--max-shard-size", default=None,
                   help="largest safetensors file of --hf-out, e.g. 5GB, 500MB, 4GiB (default 5GB)")
    p.add_argument("--hf-assets", default=None,
                   help="directory with the original config.json and tokenizer files (default: hf_assets/ inside --load, "
                        "else next to it)")
    args = p.parse_args(argv)
    if args.hf_out is None and args.peft_out is None:
        p.error("give --hf-out DIR (HF model) and/or --peft-out DIR (LoRA adapters)")
    if args.merge_lora and args.hf_out is None:
        p.error("--merge-lora writes to --hf-out DIR")
    if args.hf_out is None:  # they shape the HF model directory alone
        for flag, value in (("--hf-assets", args.hf_assets), ("--max-shard-size", args.max_shard_size)):
            if value is not None:
                p.error(f"{flag} applies to --hf-out DIR (a PEFT directory has no tokenizer files or shards)")
    if args.hf_out and args.peft_out and _overlap(args.hf_out, args.peft_out):
        p.error("--hf-out and --peft-out must be different directories, neither inside the other")
    args.max_shard_size = args.max_shard_size or "5GB"
    return args


def _overlap(a: str, b: str) -> bool:
    """Whether the directories ``a`` and ``b`` are one, or one lies inside the other."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return os.path.commonpath([a, b]) in (a, b)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_prune.arguments import tool_logging

    tool_logging()
    from megatron_prune.model.hf_convert import export_megatron_to_hf, parse_size
    from megatron_prune.training.checkpoint import CheckpointError

    try:
        parse_size(args.max_shard_size)
        from megatron_prune.model.hf_convert import check_output_dir
        from megatron_prune.model.lora_base import META_KEY, resolve_base
        from megatron_prune.model.lora_export import check_peft_export, checkpoint_lora, export_merged, export_peft
        from megatron_prune.training.checkpoint import read_meta

        meta = read_meta(args.load)
        lora = checkpoint_lora(meta)
        # Every output is checked before any is written: a refused second one left the first behind.
        for flag, path in (("--hf-out", args.hf_out), ("--peft-out", args.peft_out)):
            if path:
                check_output_dir(path, flag=flag)
        base = None
        if lora is not None:
            if args.hf_out and not args.merge_lora:
                raise ValueError(f"{args.load} holds LoRA adapters (rank {lora['rank']}): pass --merge-lora to write "
                                 "merged HF weights, or --peft-out DIR for the adapters alone")
            if args.peft_out:
                check_peft_export(meta)
            # The frozen base is not in a LoRA checkpoint: find it (and check it) before any rank works.
            base = resolve_base(meta.get(META_KEY), ckpt=meta["path"], override=args.base_hf, flag="--base-hf",
                                megatron_override=args.base_load)
        elif args.peft_out:
            raise ValueError(f"--peft-out: {meta['path']} holds no LoRA adapters (not trained with --lora-rank), "
                             "so there are none to write; export its weights with --hf-out DIR")
        elif args.base_hf or args.base_load:
            flag = "--base-hf" if args.base_hf else "--base-load"
            raise ValueError(f"{flag}: {meta['path']} holds no LoRA adapters, so it needs no base model")
        from megatron_prune.training.parallel import initialize_distributed

        initialize_distributed()
        files = []
        if args.merge_lora:
            files += export_merged(load_dir=args.load, hf_out=args.hf_out, dtype=args.dtype,
                                   max_shard_size=args.max_shard_size, hf_assets=args.hf_assets, base=base)
        elif args.hf_out:
            files += export_megatron_to_hf(load_dir=args.load, hf_out=args.hf_out, dtype=args.dtype,
                                           max_shard_size=args.max_shard_size, hf_assets=args.hf_assets)
        if args.peft_out:
            files += export_peft(load_dir=args.load, peft_out=args.peft_out, dtype=args.dtype, base=base)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        from megatron_prune.training.session import fail_usage

        fail_usage(exc)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"wrote {', '.join(d for d in (args.hf_out, args.peft_out) if d)}: {', '.join(files)}")
        if args.peft_out and base is not None and base.kind != "hf":
            print(f"note: {args.peft_out}/adapter_config.json names no base_model_name_or_path: {_no_hf_base(base)}")
    return 0


def _no_hf_base(base) -> str:
    """How to load a PEFT export whose frozen base is not an HF directory."""
    if base.kind == "megatron":
        return (f"the base is the Megatron checkpoint {base.path}; convert it once (python "
                f"tools/convert_megatron_to_hf.py --load {base.path} --hf-out BASE_HF) and load the adapters onto "
                "BASE_HF, or export merged weights with --hf-out DIR --merge-lora")
    return (f"the base is the built-in preset {base.name!r} (seed {base.seed}), which has no HF directory; export "
            "merged weights with --hf-out DIR --merge-lora instead")


if __name__ == "__main__":
    code = main()
    from megatron_prune.training.parallel import shutdown_distributed

    shutdown_distributed()  # every rank returned: leave no gloo group to interpreter teardown
    sys.exit(code)
