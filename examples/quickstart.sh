#!/usr/bin/env bash
# Quick start: install into .venv (once) and run the main job — a short DPO run of the tiny
# preset with every pruning on, given as explicit flags (position alpha=0.6, sequence
# rho_min=0.5, branch q_w=0.5; without --prune-* flags DPO runs exact), on the bundled HH-RLHF
# sample, 2 CPU ranks with tensor parallelism 2. Prints one progress line per step, the held-out
# reward accuracy (chance = 0.5) every 20 steps, and at the end what the numbers mean and what to
# run next.
#
# Overrides: NPROC (ranks), TP, PP, STEPS, GBS (pairs per step), MBS, EVAL_INTERVAL, OUT (output
# folder), INSTALL=1 (reinstall into .venv), TORCH_INDEX_URL (the index torch is installed from),
# DRY_RUN=1 (print the command only; installs nothing). Flags after the script name are appended to the
# launch and override its own (the last of a repeated flag wins).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
TP=${TP:-2}
PP=${PP:-1}
STEPS=${STEPS:-40}
GBS=${GBS:-16}
MBS=${MBS:-4}
EVAL_INTERVAL=${EVAL_INTERVAL:-20}
OUT=${OUT:-outputs/quickstart}
WARMUP=$(( STEPS > 4 ? 2 : STEPS / 2 ))  # 2 warm-up steps, fewer for a run of a few steps

SAMPLES=megatron_prune/data/samples
CMD=(torchrun --nproc-per-node "$NPROC" -m megatron_prune.dpo
  --model-preset tiny
  --data-path "$SAMPLES/hh_rlhf_sample.jsonl"
  --eval-data-path "$SAMPLES/hh_rlhf_heldout.jsonl" --eval-interval "$EVAL_INTERVAL"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --train-iters "$STEPS" --global-batch-size "$GBS" --micro-batch-size "$MBS"
  --seq-length 256 --max-prompt-length 128
  --optimizer adam --lr 1e-3 --lr-warmup-iters "$WARMUP" --clip-grad 1.0
  --prune-position-ratio 0.6 --prune-seq-min-ratio 0.5 --prune-branch
  --dpo-beta 1.0 --device cpu
  --metrics-jsonl "$OUT/metrics.jsonl"
  "$@")  # flags after the script name come last, so they override the script's

if [ "${DRY_RUN:-0}" = "1" ]; then
  printf "%q " "${CMD[@]}"; echo
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
# Installed once (the project and its CPU torch); INSTALL=1 reinstalls, e.g. after a pull.
if [ "${INSTALL:-0}" = "1" ] || ! python -c "import importlib.metadata as m; m.version('megatron-prune'); import torch, megatron.core" 2>/dev/null; then
  # TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) picks the index torch comes from
  python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  python -m pip install -q -e .
fi

mkdir -p "$OUT"
rm -f "$OUT/metrics.jsonl"
OMP_NUM_THREADS=1 "${CMD[@]}"

python - "$OUT/metrics.jsonl" <<'PY'
import json, sys

path = sys.argv[1]
records = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
last = records[-1]
evals = [r for r in records if "eval_reward_accuracy" in r]
print()
print(f"Done: {len(records)} DPO steps, last training loss {last['loss']:.4f} (log 2 = 0.6931 at the start).")
if evals:
    print(f"Held-out reward accuracy {evals[-1]['eval_reward_accuracy']:.3f}: the fraction of held-out pairs whose "
          "chosen response the policy now prefers more than the reference does (0.5 = chance; ties count 1/2).")
print(f"Pruning: {int(last['train_tokens'])} tokens ran forward+backward and {int(last['forward_only_tokens'])} "
      "forward only in the last step (reference model and the pruned branch).")
print(f"Metrics, one JSON line per step: {path}")
print("Next: exact DPO (drop the --prune-* flags), the GRPO example `bash examples/grpo_cpu.sh`, HF conversion "
      "`python tools/convert_hf_to_megatron.py --help`, the benchmark `python tools/bench_dpo.py --preset cpu-small`; "
      "for them in this shell: `. .venv/bin/activate`.")
PY
