#!/usr/bin/env bash
# GRPO with DPPO pruning on Ascend 910B through MindSpeed: one node of 8 NPUs, or several nodes.
#
#   HF_MODEL=/models/Qwen3-4B bash examples/ascend/grpo.sh                    # 8 x 910B, one node
#   NODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 HF_MODEL=... bash examples/ascend/grpo.sh  # on node 0
#   NODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 HF_MODEL=... bash examples/ascend/grpo.sh  # on node 1
#   DRY_RUN=1 HF_MODEL=/models/Qwen3-4B bash examples/ascend/grpo.sh          # print env and command
#
# Overrides (defaults in brackets):
#   HF_MODEL  local HF model directory (required)
#   TASK [gsm8k]  DATA  problem file [bundled GSM8K sample]
#   GPUS [8]  NODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]
#   TP [2]  PP [1]  GBS [64]  MBS [8]  SEQ [2048]  ITERS [500]  LR [1e-6]  GROUP [8]  NEW_TOKENS [1024]
#   PRUNE_PROMPTS [0.3]  PRUNE_COMPLETIONS [0.3]  PACK [1] (--dense-packing)  OUT [runs/grpo-910b]
#   FLASH_ATTN [1]  MindSpeed's fused attention (--use-flash-attn)
#   THINKING [1]  0: Qwen3's non-thinking mode (--chat-template-kwargs '{"enable_thinking": false}')
#   EXTRA  more flags, appended; arguments after the script name are appended too
#   Ascend environment (HCCL timeouts, allocator, task queue, CPU affinity, visible devices): env.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/ascend/env.sh
source examples/ascend/env.sh
ascend_setup_env

[ "${DRY_RUN:-0}" = "1" ] && HF_MODEL=${HF_MODEL:-/models/Qwen3-4B}  # a dry run prints a placeholder
HF_MODEL=${HF_MODEL:?set HF_MODEL to a local HF model directory, e.g. /models/Qwen3-4B}
TASK=${TASK:-gsm8k}; DATA=${DATA:-megatron_prune/data/samples/gsm8k_sample.jsonl}
TP=${TP:-2}; PP=${PP:-1}
GBS=${GBS:-64}; MBS=${MBS:-8}; SEQ=${SEQ:-2048}; ITERS=${ITERS:-500}; LR=${LR:-1e-6}
GROUP=${GROUP:-8}; NEW_TOKENS=${NEW_TOKENS:-1024}
PRUNE_PROMPTS=${PRUNE_PROMPTS:-0.3}; PRUNE_COMPLETIONS=${PRUNE_COMPLETIONS:-0.3}
OUT=${OUT:-runs/grpo-910b}

ARGS=(--device npu --hf-model "$HF_MODEL" --bf16 --task "$TASK" --data-path "$DATA"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --use-distributed-optimizer
  --train-iters "$ITERS" --global-batch-size "$GBS" --micro-batch-size "$MBS"
  --seq-length "$SEQ" --max-prompt-length 512
  --group-size "$GROUP" --max-new-tokens "$NEW_TOKENS" --temperature 1.0 --top-p 1.0
  --lr "$LR" --lr-warmup-iters 10 --clip-grad 1.0 --clip-eps-low 0.2 --clip-eps-high 0.28 --kl-beta 0.0
  --ppo-epochs 1 --minibatches 2
  --dppo-prompt-prune-rate "$PRUNE_PROMPTS" --dppo-completion-prune-rate "$PRUNE_COMPLETIONS"
  --save "$OUT/ckpt" --save-interval 50 --metrics-jsonl "$OUT/metrics.jsonl")
[ "$TP" -gt 1 ] && ARGS+=(--sequence-parallel)
[ "${PACK:-1}" = 1 ] && ARGS+=(--dense-packing)
[ "${FLASH_ATTN:-1}" = 1 ] && ARGS+=(--use-flash-attn)
[ "${THINKING:-1}" = 0 ] && ARGS+=(--chat-template-kwargs '{"enable_thinking": false}')
[ -f "$OUT/ckpt/latest_checkpointed_iteration.txt" ] && ARGS+=(--load "$OUT/ckpt")
# shellcheck disable=SC2206
ARGS+=(${EXTRA:-})

ascend_launcher
CMD=("${LAUNCH[@]}" -m megatron_prune.grpo "${ARGS[@]}" "$@")
if [ "${DRY_RUN:-0}" != 1 ]; then mkdir -p "$OUT"; fi
ascend_run
