#!/usr/bin/env bash
# Set up (once) and run the default test suite: bash tests/run.sh [pytest args]
# Creates .venv if absent, installs torch 2.13.0 first from pip's index (pinned: an unpinned
# torch would pull a newer multi-GB build), then the project with its test extra, then runs
# pytest. Where pip's default index serves the CUDA build of torch 2.13.0 (PyPI on Linux), set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to install the CPU build from PyTorch's index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
python -m pip install -q -e ".[test]"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tests/run.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
