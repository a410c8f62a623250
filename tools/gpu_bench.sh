#!/usr/bin/env bash
# One command for a GPU machine (sized for one H200): the DPO pruning benchmark at the dense GPU
# presets, the Qwen3-4B slice again with LoRA rank 64 (the study's configuration), a Qwen3-30B-A3B
# (mixture-of-experts) slice, then the GPU-marked tests. Everything lands in $OUT (default ./bench_out):
#   qwen3-0.6b.{json,png,log}, qwen3-4b-slice.{json,png,log}, qwen3-4b-slice-lora64.{json,png,log},
#   qwen3-30b-a3b-slice.{json,png,log}, pytest-gpu.log, env.txt, summary.txt
# Budget: under 14 minutes in all (each step has its own timeout; bench_dpo rewrites its JSON after
# every mode, so a step cut short still leaves the modes it finished).
#
#   bash tools/gpu_bench.sh                 # from the repository root
#   OUT=/tmp/res PYTHON=python3 bash tools/gpu_bench.sh
#   DRY_RUN=1 bash tools/gpu_bench.sh       # print the commands only
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./bench_out}"
PYTHON="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"
mkdir -p "$OUT"
export PYTHONWARNINGS=ignore PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
: > "$OUT/summary.txt"

run() {  # run NAME TIMEOUT_S CMD...: print it, run it under a timeout, log output and exit status
  local name=$1 limit=$2; shift 2
  echo "+ [$name, timeout ${limit}s] $*" | tee -a "$OUT/summary.txt"
  if [ "$DRY_RUN" = 1 ]; then return 0; fi
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "  -> $name: exit $rc after $((SECONDS - t0))s (log: $OUT/$name.log)" | tee -a "$OUT/summary.txt"
  tail -n 14 "$OUT/$name.log"
}

if [ "$DRY_RUN" != 1 ]; then
  {
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PYTHON" -c "import torch, megatron.core as mc; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available()); print('megatron-core', mc.__version__)" 2>&1
    "$PYTHON" -c "import transformer_engine; print('transformer_engine', transformer_engine.__version__)" 2>&1 \
      || echo "transformer_engine: not installed (local layer spec)"
    git log --oneline -1 2>/dev/null
  } > "$OUT/env.txt"
  cat "$OUT/env.txt"
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_bench: torch.cuda.is_available() is False for $PYTHON; set PYTHON to a CUDA-enabled interpreter" >&2
    exit 2
  fi
fi

# Qwen3-0.6B shape: ten modes (full is in the 4B slice; shared_packed is left out), 2 warm-up +
# 5 timed steps each (~20 s a mode).
run qwen3-0.6b 230 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-0.6b --memory-steps 2 --timeout 90 \
  --modes concat selective position sequence branch position_branch all shared shared_all shared_all_packed \
  --json "$OUT/qwen3-0.6b.json" --plot "$OUT/qwen3-0.6b.png"
# Qwen3-4B widths, 8 layers: the modes the goals are judged on first, fewer steps.
run qwen3-4b-slice 170 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-4b-slice --warmup 1 --steps 3 --memory-steps 1 --timeout 80 \
  --modes concat branch position_branch sequence selective full \
  --json "$OUT/qwen3-4b-slice.json" --plot "$OUT/qwen3-4b-slice.png"
# The same slice with LoRA rank 64 on every linear and the adapter-off reference; bench_dpo then
# runs full-parameter concat once more for the memory comparison (total_mem_ratio_vs_full_param).
run qwen3-4b-slice-lora64 190 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-4b-slice --lora-rank 64 --warmup 1 --steps 3 --memory-steps 1 --timeout 70 \
  --modes concat branch position_branch concat_packed branch_packed \
  --json "$OUT/qwen3-4b-slice-lora64.json" --plot "$OUT/qwen3-4b-slice-lora64.png"
# Qwen3-30B-A3B's widths (128 experts, top-8), 6 of 48 layers, EP=1 on the one GPU (~87 GB of
# training state): the modes the goals are judged on, 1 warm-up + 3 timed steps of 16 pairs each.
run qwen3-30b-a3b-slice 200 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-30b-a3b-slice --memory-steps 1 --timeout 90 \
  --modes concat branch position_branch \
  --json "$OUT/qwen3-30b-a3b-slice.json" --plot "$OUT/qwen3-30b-a3b-slice.png"
run pytest-gpu 60 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider
echo "results in $OUT:"; ls -l "$OUT"
