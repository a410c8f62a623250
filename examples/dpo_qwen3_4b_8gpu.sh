#!/usr/bin/env bash
# DPO of Qwen3-4B on one node of 8 GPUs with all three prunings (the study's setting).
#
#   HF_MODEL=/models/Qwen3-4B DATA=/data/prefs.jsonl bash examples/dpo_qwen3_4b_8gpu.sh
#
# Overrides: GPUS (8), TP (2), PP (1), GBS (64), MBS (2), SEQ (2048), STEPS (1000), LR (5e-7),
# ALPHA (0.6), RHO_MIN (0.5), BRANCH (1), LAYOUT (concat), SAVE (ckpt/qwen3-4b-dpo),
# EXTRA (more flags; flags after the script name are appended too), DRY_RUN=1 (print the command only), SHUTDOWN_TIMEOUT (600: seconds torchrun
# waits after SIGTERM before it kills the ranks; above one step and one save, so --exit-signal-handler
# can finish the step and save; torchrun's default is 30 s).
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's environment (created by examples/quickstart.sh), unless one is active already.
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
if [ "${DRY_RUN:-0}" = "1" ]; then  # print the command with placeholders for what is not set
  HF_MODEL=${HF_MODEL:-/models/Qwen3-4B}; DATA=${DATA:-/data/prefs.jsonl}
fi
HF_MODEL=${HF_MODEL:?set HF_MODEL to a local HF directory, e.g. /models/Qwen3-4B}
DATA=${DATA:?set DATA to a preference file (JSONL/Parquet)}
GPUS=${GPUS:-8}; TP=${TP:-2}; PP=${PP:-1}
GBS=${GBS:-64}; MBS=${MBS:-2}; SEQ=${SEQ:-2048}; STEPS=${STEPS:-1000}; LR=${LR:-5e-7}
ALPHA=${ALPHA:-0.6}; RHO_MIN=${RHO_MIN:-0.5}; BRANCH=${BRANCH:-1}; LAYOUT=${LAYOUT:-concat}
SAVE=${SAVE:-ckpt/qwen3-4b-dpo}

ARGS=(--hf-model "$HF_MODEL" --data-path "$DATA"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --global-batch-size "$GBS" --micro-batch-size "$MBS" --seq-length "$SEQ" --max-prompt-length $((SEQ / 2))
  --train-iters "$STEPS" --lr "$LR" --min-lr 0 --lr-warmup-iters 20 --lr-decay-style cosine
  --bf16 --use-distributed-optimizer --dpo-layout "$LAYOUT" --dpo-beta 1.0
  --prune-position-ratio "$ALPHA" --prune-seq-min-ratio "$RHO_MIN"
  --save "$SAVE" --load "$SAVE" --save-interval 100 --exit-signal-handler --metrics-jsonl "$SAVE/metrics.jsonl")
[ "$TP" -gt 1 ] && ARGS+=(--sequence-parallel)
[ "$BRANCH" = "1" ] && ARGS+=(--prune-branch)
# shellcheck disable=SC2206
ARGS+=(${EXTRA:-} "$@")  # flags after the script name come last, so they override the script's

CMD=(torchrun --nproc-per-node "$GPUS" --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}" -m megatron_prune.dpo "${ARGS[@]}")
if [ "${DRY_RUN:-0}" = "1" ]; then
  printf "%q " "${CMD[@]}"; echo  # quoted: pastes back as is
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec "${CMD[@]}"
