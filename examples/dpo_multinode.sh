#!/usr/bin/env bash
# Multi-node DPO with graph pruning: run this script once on every node.
#
#   NODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 GPUS=8 TP=2 PP=2 bash examples/dpo_multinode.sh
#   NODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 GPUS=8 TP=2 PP=2 bash examples/dpo_multinode.sh
#
# torchrun's c10d rendezvous (--nnodes/--node-rank/--rdzv-*) meets at MASTER_ADDR:MASTER_PORT; node 0
# hosts it. Under c10d torchrun assigns the global ranks itself (it says NODE_RANK is ignored): the
# first rank of the last pipeline stage, which logs progress and writes metrics, may run on any node,
# and a refused flag is printed by the first rank of every node. Launch every node with the same flags
# and data; SAVE must be a directory every node shares.
# Arguments after the script name are appended to (and override) the plugin flags below.
#
# Environment (defaults in brackets):
#   NODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]  RDZV_ID [megatron-prune-dpo]
#   GPUS       processes per node [all visible GPUs, else 1]
#   TP [1]  PP [1]                 tensor / pipeline parallel sizes (DP = NODES*GPUS / (TP*PP))
#   MODEL      --model-preset NAME, or an HF model directory [tiny]
#   DATA       preference JSONL/Parquet [bundled HH-RLHF sample]
#   SAVE       checkpoint directory; a rerun resumes from it [none]; SAVE_INTERVAL steps between saves [10]
#   SHUTDOWN_TIMEOUT  seconds torchrun waits after SIGTERM before it kills the ranks, with SAVE [600]
#   TRAIN_ITERS [20]  GBS [8]  MBS [1]  SEQ_LEN [256]  MAX_PROMPT_LEN [SEQ_LEN / 2]  LR [1e-6]
#   PYTHON     interpreter that runs torchrun [.venv/bin/python when present, else python]
#   DRY_RUN=1  print the command instead of running it
set -euo pipefail
cd "$(dirname "$0")/.."

NODES=${NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-megatron-prune-dpo}
if [ -z "${GPUS:-}" ]; then
  GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${GPUS:-0}" -gt 0 ] 2>/dev/null || GPUS=1
fi
TP=${TP:-1}
PP=${PP:-1}
MODEL=${MODEL:-tiny}
DATA=${DATA:-megatron_prune/data/samples/hh_rlhf_sample.jsonl}
if [ -z "${PYTHON:-}" ]; then
  if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

if [ -d "$MODEL" ]; then MODEL_ARGS=(--hf-model "$MODEL"); else MODEL_ARGS=(--model-preset "$MODEL"); fi

LAUNCH=(
  "$PYTHON" -m torch.distributed.run
  --nnodes "$NODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS"
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
)
PLUGIN=(
  -m megatron_prune.dpo "${MODEL_ARGS[@]}" --data-path "$DATA"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --train-iters "${TRAIN_ITERS:-20}" --global-batch-size "${GBS:-8}" --micro-batch-size "${MBS:-1}"
  --seq-length "${SEQ_LEN:-256}" --max-prompt-length "${MAX_PROMPT_LEN:-$(( ${SEQ_LEN:-256} / 2 ))}"
  --lr "${LR:-1e-6}"
  --prune-position-ratio 0.6 --prune-seq-min-ratio 0.5 --prune-branch
)
if [ -n "${SAVE:-}" ]; then
  # A first launch starts fresh, a rerun resumes; SIGTERM (scancel, preemption) saves after the step in progress.
  PLUGIN+=(--save "$SAVE" --load "$SAVE" --save-interval "${SAVE_INTERVAL:-10}" --exit-signal-handler)
  LAUNCH+=(--shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}")  # torchrun's 30 s would cut the step and save
fi

CMD=("${LAUNCH[@]}" "${PLUGIN[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${CMD[@]}"
