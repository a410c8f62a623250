#!/usr/bin/env bash
# Quick start: install into .venv (once) and run the main job — a short DPO run of the tiny
# preset with every pruning on (position alpha=0.6, sequence rho_min=0.5, branch q=0.5), on the
# bundled HH-RLHF sample, 2 CPU ranks with tensor parallelism 2. Prints one progress line per
# step and the held-out reward accuracy (chance = 0.5) every 20 steps.
#
# Overrides: NPROC (ranks), TP, PP, STEPS, OUT (output folder), DRY_RUN=1 (print the command only).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
TP=${TP:-2}
PP=${PP:-1}
STEPS=${STEPS:-40}
OUT=${OUT:-outputs/quickstart}

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q torch==2.13.0
python -m pip install -q -e .

SAMPLES=megatron_prune/data/samples
CMD=(torchrun --nproc-per-node "$NPROC" -m megatron_prune.dpo
  --model-preset tiny
  --data-path "$SAMPLES/hh_rlhf_sample.jsonl"
  --eval-data-path "$SAMPLES/hh_rlhf_heldout.jsonl" --eval-interval 20
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --train-iters "$STEPS" --global-batch-size 16 --micro-batch-size 4
  --seq-length 256 --max-prompt-length 128
  --optimizer adam --lr 1e-3 --lr-warmup-iters 2 --clip-grad 1.0
  --prune-position-ratio 0.6 --prune-seq-min-ratio 0.5 --prune-branch
  --dpo-beta 1.0 --device cpu
  --metrics-jsonl "$OUT/metrics.jsonl")

if [ "${DRY_RUN:-0}" = "1" ]; then
  echo "${CMD[@]}"
  exit 0
fi
mkdir -p "$OUT"
rm -f "$OUT/metrics.jsonl"
OMP_NUM_THREADS=1 "${CMD[@]}"
echo "metrics: $OUT/metrics.jsonl"
