#!/usr/bin/env bash
# GRPO + DPPO on Qwen3-4B / GSM8K (or MATH with TASK=math), one or more 8-GPU nodes.
# Overrides: GPUS=8 NODES=1 NODE_RANK=0 MASTER_ADDR=localhost MASTER_PORT=29500 TP=2 PP=1
#   HF_MODEL=/models/Qwen3-4B DATA=megatron_prune/data/samples/gsm8k_sample.jsonl (the bundled sample;
#   point it at your full train.jsonl) TASK=gsm8k ITERS=500
#   PRUNE_PROMPTS=0.3 PRUNE_COMPLETIONS=0.3 OUT=runs/grpo_qwen3_4b DRY_RUN=1 (print the command only)
#   Flags after the script name are appended (the last of a repeated flag wins).
#   THINKING=1: Qwen3's thinking mode (its template's default); THINKING=0 renders every prompt in its
#   non-thinking mode (--chat-template-kwargs '{"enable_thinking": false}'), shorter completions
#   SHUTDOWN_TIMEOUT=900: seconds torchrun waits after SIGTERM before it kills the ranks; above one
#   step and one save, so --exit-signal-handler can finish the step and save (torchrun's default: 30 s)
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's environment (created by examples/quickstart.sh), unless one is active already.
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
GPUS=${GPUS:-8}; NODES=${NODES:-1}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-2}; PP=${PP:-1}; ITERS=${ITERS:-500}
HF_MODEL=${HF_MODEL:-/models/Qwen3-4B}; TASK=${TASK:-gsm8k}; DATA=${DATA:-megatron_prune/data/samples/gsm8k_sample.jsonl}
PRUNE_PROMPTS=${PRUNE_PROMPTS:-0.3}; PRUNE_COMPLETIONS=${PRUNE_COMPLETIONS:-0.3}
OUT=${OUT:-runs/grpo_qwen3_4b}
cmd=(torchrun --nnodes "$NODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS"
  --shutdown-timeout "${SHUTDOWN_TIMEOUT:-900}"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m megatron_prune.grpo
  --hf-model "$HF_MODEL" --bf16 --task "$TASK" --data-path "$DATA"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --use-distributed-optimizer
  --train-iters "$ITERS" --global-batch-size 64 --micro-batch-size 8 --seq-length 2048 --max-prompt-length 512
  --group-size 8 --max-new-tokens 1024 --temperature 1.0 --top-p 1.0 --rollout-micro-batch-size 64
  --lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 --clip-eps-low 0.2 --clip-eps-high 0.28 --kl-beta 0.0
  --ppo-epochs 1 --minibatches 2
  --dppo-prompt-prune-rate "$PRUNE_PROMPTS" --dppo-completion-prune-rate "$PRUNE_COMPLETIONS" --dense-packing
  --save "$OUT/ckpt" --load "$OUT/ckpt" --save-interval 50 --exit-signal-handler --metrics-jsonl "$OUT/metrics.jsonl")
if [[ "${THINKING:-1}" == 0 ]]; then cmd+=(--chat-template-kwargs '{"enable_thinking": false}'); fi
cmd+=("$@")  # flags after the script name come last, so they override the script's
if [[ "${DRY_RUN:-0}" == 1 ]]; then printf "%q " "${cmd[@]}"; echo; exit 0; fi  # quoted: pastes back as is
mkdir -p "$OUT"
exec "${cmd[@]}"
