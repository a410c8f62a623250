#!/usr/bin/env bash
# GRPO (+ DPPO) on the toy task with the tiny preset: 2 CPU ranks (TP=2 by default), a couple of minutes.
# Overrides: NPROC=2 TP=2 PP=1 ITERS=20 PRUNE_PROMPTS=0.3 PRUNE_COMPLETIONS=0.3 PACK=1 OUT=/tmp/grpo_cpu DRY_RUN=1
set -euo pipefail
NPROC=${NPROC:-2}; TP=${TP:-2}; PP=${PP:-1}; ITERS=${ITERS:-20}
PRUNE_PROMPTS=${PRUNE_PROMPTS:-0.3}; PRUNE_COMPLETIONS=${PRUNE_COMPLETIONS:-0.3}; PACK=${PACK:-1}
OUT=${OUT:-/tmp/grpo_cpu}
cmd=(torchrun --nproc-per-node "$NPROC" -m megatron_prune.grpo
  --model-preset tiny --device cpu --task toy --toy-num-prompts 64
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --train-iters "$ITERS" --global-batch-size 16 --micro-batch-size 16 --seq-length 64
  --group-size 8 --max-new-tokens 8 --lr 1e-2 --clip-grad 1.0 --seed 1234
  --dppo-prompt-prune-rate "$PRUNE_PROMPTS" --dppo-completion-prune-rate "$PRUNE_COMPLETIONS"
  --metrics-jsonl "$OUT/metrics.jsonl")
[[ "$PACK" == 1 ]] && cmd+=(--dense-packing)
if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "OMP_NUM_THREADS=1 ${cmd[*]}"; exit 0; fi
mkdir -p "$OUT"
OMP_NUM_THREADS=1 exec "${cmd[@]}"
