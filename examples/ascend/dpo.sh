#!/usr/bin/env bash
# DPO with graph pruning on Ascend 910B through MindSpeed: one node of 8 NPUs, or several nodes.
#
#   HF_MODEL=/models/Qwen3-4B bash examples/ascend/dpo.sh                     # 8 x 910B, one node
#   NODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 HF_MODEL=... bash examples/ascend/dpo.sh   # on node 0
#   NODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 HF_MODEL=... bash examples/ascend/dpo.sh   # on node 1
#   DRY_RUN=1 HF_MODEL=/models/Qwen3-4B bash examples/ascend/dpo.sh           # print env and command
#
# Overrides (defaults in brackets):
#   HF_MODEL  local HF model directory (required)      DATA  preference JSONL/Parquet [bundled HH-RLHF sample]
#   GPUS [8]  NODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]
#   TP [2]  PP [1]  GBS [64]  MBS [2]  SEQ [2048]  STEPS [1000]  LR [5e-7]
#   ALPHA [0.6]  RHO_MIN [0.5]  BRANCH [1]  LAYOUT [concat]  SAVE [ckpt/dpo-910b] (a rerun resumes)
#   FLASH_ATTN [1]  MindSpeed's fused attention (--use-flash-attn)
#   EXTRA  more flags, appended; arguments after the script name are appended too
#   Ascend environment (HCCL timeouts, allocator, task queue, CPU affinity, visible devices): env.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/ascend/env.sh
source examples/ascend/env.sh
ascend_setup_env

[ "${DRY_RUN:-0}" = "1" ] && HF_MODEL=${HF_MODEL:-/models/Qwen3-4B}  # a dry run prints a placeholder
HF_MODEL=${HF_MODEL:?set HF_MODEL to a local HF model directory, e.g. /models/Qwen3-4B}
DATA=${DATA:-megatron_prune/data/samples/hh_rlhf_sample.jsonl}
TP=${TP:-2}; PP=${PP:-1}
GBS=${GBS:-64}; MBS=${MBS:-2}; SEQ=${SEQ:-2048}; STEPS=${STEPS:-1000}; LR=${LR:-5e-7}
ALPHA=${ALPHA:-0.6}; RHO_MIN=${RHO_MIN:-0.5}; BRANCH=${BRANCH:-1}; LAYOUT=${LAYOUT:-concat}
SAVE=${SAVE:-ckpt/dpo-910b}

ARGS=(--device npu --hf-model "$HF_MODEL" --data-path "$DATA"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --global-batch-size "$GBS" --micro-batch-size "$MBS" --seq-length "$SEQ" --max-prompt-length $((SEQ / 2))
  --train-iters "$STEPS" --lr "$LR" --min-lr 0 --lr-warmup-iters 20 --lr-decay-style cosine
  --bf16 --use-distributed-optimizer --dpo-layout "$LAYOUT" --dpo-beta 1.0
  --prune-position-ratio "$ALPHA" --prune-seq-min-ratio "$RHO_MIN"
  --save "$SAVE" --save-interval 100 --metrics-jsonl "$SAVE/metrics.jsonl")
[ "$TP" -gt 1 ] && ARGS+=(--sequence-parallel)
[ "$BRANCH" = 1 ] && ARGS+=(--prune-branch)
[ "${FLASH_ATTN:-1}" = 1 ] && ARGS+=(--use-flash-attn)
[ -f "$SAVE/latest_checkpointed_iteration.txt" ] && ARGS+=(--load "$SAVE")
# shellcheck disable=SC2206
ARGS+=(${EXTRA:-})

ascend_launcher
CMD=("${LAUNCH[@]}" -m megatron_prune.dpo "${ARGS[@]}" "$@")
ascend_run
