#!/usr/bin/env bash
# The GPU check from a checkout: `bash bench/gpu_check.sh ARGS` is `dflash-gpu-check ARGS` (chapter
# nbs/13d_gpu_check.ipynb; --help lists the flags) with this checkout's dflash_nb, for a GPU box whose python has the
# GPU stack (torch, triton, transformers) but not this package installed. `$PYTHON` picks that python (default python3).
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || { echo "gpu_check.sh: no python: '$PYTHON' not found (set PYTHON=/path/to/python)" >&2; exit 2; }
"$PYTHON" -c "import torch" 2>/dev/null || { echo "gpu_check.sh: '$PYTHON' has no torch (set PYTHON to the python of the GPU stack)" >&2; exit 2; }
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m dflash_nb.gpu_check "$@"
