#!/usr/bin/env bash
# One command for a GPU machine (sized for one H200), in order of what it settles first: the GPU
# tests (the DPO step on CUDA against the CPU step, bf16 DPO and GRPO through the CLI), the DPO
# pruning benchmark at Qwen3-0.6B's shape (the shared-prompt and branch modes), the Qwen3-4B
# slice with LoRA rank 64, the same slice full-parameter, then a Qwen3-30B-A3B
# (mixture-of-experts) slice. Everything lands in $OUT (default ./bench_out):
#   pytest-gpu.log, qwen3-0.6b.{json,png,log}, qwen3-4b-slice-lora64.{json,png,log},
#   qwen3-4b-slice.{json,png,log}, qwen3-30b-a3b-slice.{json,png,log}, env.txt, summary.txt
#
# BUDGET_S (default 840) is the whole run's wall-clock budget: a step starts only when at least
# MIN_STEP_S (default 60) seconds are left and runs under the smaller of its own timeout and what
# is left. bench_dpo rewrites its JSON and plot after every mode, so a step cut short keeps the
# modes it finished (their order puts the comparisons that matter most first); steps not started
# are listed in summary.txt as skipped. STEPS (default: all) names the steps to run, e.g.
# STEPS="qwen3-0.6b qwen3-4b-slice-lora64", to split the work over several commands. Measured on
# one H200: pytest-gpu took ~125 s before its three recompute runs were added (about 3 × 20 s
# more, hence its 240 s cap); one bench mode at Qwen3-0.6B's shape
# takes over a minute (process start, model build, warm-up, timed and replayed steps). The steps'
# caps add up to 1220 s, so the default budget covers the first steps only: expect the LoRA step
# to be cut before its full-parameter comparison and the last two steps to be skipped, and run
# them in a second command (STEPS="qwen3-4b-slice-lora64 qwen3-4b-slice qwen3-30b-a3b-slice").
#
#   bash tools/gpu_bench.sh                 # from the repository root
#   OUT=/tmp/res PYTHON=python3 BUDGET_S=480 bash tools/gpu_bench.sh
#   DRY_RUN=1 bash tools/gpu_bench.sh       # print the commands only (writes nothing)
#
# Exit status: 0 when every step that started exited 0; 1 when one failed or was cut short by its
# timeout (summary.txt says which); 2 for an unknown name in STEPS or a machine that cannot run it.
set -u
OUT="$(realpath -m "${OUT:-./bench_out}")"  # relative to where it was launched, before the cd
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"
BUDGET_S="${BUDGET_S:-840}"
MIN_STEP_S="${MIN_STEP_S:-60}"
STEPS="${STEPS:-}"
KNOWN_STEPS="pytest-gpu qwen3-0.6b qwen3-4b-slice-lora64 qwen3-4b-slice qwen3-30b-a3b-slice"
for step in $STEPS; do
  if [[ " $KNOWN_STEPS " != *" $step "* ]]; then
    echo "gpu_bench: STEPS names an unknown step '$step'; the steps are: $KNOWN_STEPS" >&2
    exit 2
  fi
done
export PYTHONWARNINGS=ignore PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY_RUN" != 1 ]; then
  mkdir -p "$OUT"
  : > "$OUT/summary.txt"
fi
START=$SECONDS
FAILED=0

say() {  # print a line, and keep it in summary.txt unless this is a dry run
  if [ "$DRY_RUN" = 1 ]; then echo "$1"; else echo "$1" | tee -a "$OUT/summary.txt"; fi
}

run() {  # run NAME TIMEOUT_S CMD...: print it, run it under a timeout within the budget, log it
  local name=$1 limit=$2; shift 2
  if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then
    return 0
  fi
  local left=$((BUDGET_S - (SECONDS - START)))
  if [ "$DRY_RUN" != 1 ] && [ "$left" -lt "$MIN_STEP_S" ]; then
    say "- [$name] skipped: ${left}s of the ${BUDGET_S}s budget left"
    return 0
  fi
  [ "$left" -lt "$limit" ] && [ "$DRY_RUN" != 1 ] && limit=$left
  say "+ [$name, timeout ${limit}s] $*"
  if [ "$DRY_RUN" = 1 ]; then return 0; fi
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] && FAILED=1
  say "  -> $name: exit $rc after $((SECONDS - t0))s (log: $OUT/$name.log)"
  tail -n 14 "$OUT/$name.log"
}

if [ "$DRY_RUN" != 1 ]; then
  {
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PYTHON" -c "import torch, megatron.core as mc; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available()); print('megatron-core', mc.__version__)" 2>&1
    "$PYTHON" -c "import transformer_engine; print('transformer_engine', transformer_engine.__version__)" 2>&1 \
      || echo "transformer_engine: not installed (local layer spec)"
    "$PYTHON" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 \
      || echo "flash_attn: not installed (segment attention runs PyTorch's scaled_dot_product_attention)"
    git log --oneline -1 2>/dev/null
  } > "$OUT/env.txt"
  cat "$OUT/env.txt"
  if ! "$PYTHON" -c "import megatron_prune.patches, megatron.core" 2>/dev/null; then
    echo "gpu_bench: $PYTHON cannot import megatron_prune (with its patches) and megatron.core; pip install -e . first" >&2
    exit 2
  fi
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_bench: torch.cuda.is_available() is False for $PYTHON; set PYTHON to a CUDA-enabled interpreter" >&2
    exit 2
  fi
fi

# Correctness first: the DPO step on CUDA equals the CPU step (fp32), and the CLI trains in bf16.
run pytest-gpu 240 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/gpu
# Qwen3-0.6B shape: the shared-prompt and branch modes against concat, 1 warm-up + 4 timed steps each.
run qwen3-0.6b 420 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-0.6b --warmup 1 --steps 4 --memory-steps 1 --timeout 110 \
  --modes concat shared shared_all branch position_branch all shared_all_packed \
  --json "$OUT/qwen3-0.6b.json" --plot "$OUT/qwen3-0.6b.png"
# Qwen3-4B widths, 8 layers, LoRA rank 64 on every linear and the adapter-off reference; bench_dpo
# then runs full-parameter concat once more for the memory comparison (total_mem_ratio_vs_full_param).
run qwen3-4b-slice-lora64 190 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-4b-slice --lora-rank 64 --warmup 1 --steps 3 --memory-steps 1 --timeout 70 \
  --modes concat branch concat_packed branch_packed \
  --json "$OUT/qwen3-4b-slice-lora64.json" --plot "$OUT/qwen3-4b-slice-lora64.png"
# The same slice full-parameter: the remaining single-pruning modes and Full (padded rows).
run qwen3-4b-slice 170 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-4b-slice --warmup 1 --steps 3 --memory-steps 1 --timeout 80 \
  --modes concat branch position_branch sequence selective full \
  --json "$OUT/qwen3-4b-slice.json" --plot "$OUT/qwen3-4b-slice.png"
# Qwen3-30B-A3B's widths (128 experts, top-8), 6 of 48 layers, EP=1 on the one GPU (~87 GB of
# training state): the modes the goals are judged on, 1 warm-up + 3 timed steps of 16 pairs each.
run qwen3-30b-a3b-slice 200 "$PYTHON" tools/bench_dpo.py --preset gpu-qwen3-30b-a3b-slice --memory-steps 1 --timeout 90 \
  --modes concat branch position_branch \
  --json "$OUT/qwen3-30b-a3b-slice.json" --plot "$OUT/qwen3-30b-a3b-slice.png"
if [ "$DRY_RUN" != 1 ]; then
  echo "results in $OUT:"; ls -l "$OUT"
fi
exit "$FAILED"
