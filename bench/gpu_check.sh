#!/usr/bin/env bash
# One-shot GPU check for an H200-class machine (torch 2.11 / triton 3.6 there, no network).
#
#   bash bench/gpu_check.sh            # from anywhere; results land in bench/results/
#
# Steps (each runs even if an earlier one failed; the exit status is non-zero if any failed):
#   1. environment report            -> bench/results/gpu_env.json
#   2. `pytest -m gpu tests/`         -> bench/results/gpu_tests.xml (+ log): bf16 parity of the Triton kernel (and
#                                        flex through dflash_nb.attention when present) against the dense reference
#   3. bench/attention.py             -> bench/results/attention.json: triton vs flex vs sdpa, fwd+bwd, TFLOP/s,
#                                        shared memory of every launched config
#   4. every other bench/*.py (bench/pipeline.py first when present), run with its own defaults; each writes its JSON
#      into bench/results/ itself
# Everything printed is also kept in bench/results/gpu_check.log.
#
# Import path: setup.py maps kernels/ to dflash_nb.kernels, which a plain checkout cannot import without an install.
# Instead of installing anything, the script copies dflash_nb/ and kernels/ into a throw-away package tree and runs
# every step from there (PYTHONPATH), so the machine's Python environment is left untouched.
#
# Knobs (environment): PY (python with CUDA torch; default: first of .venv/bin/python, python3, python that sees a
# GPU), TESTS_TIMEOUT (s, default 900), BENCH_TIMEOUT (s, default 1500), OTHER_TIMEOUT (s per bench, default 900),
# BENCH_ARGS (extra args for bench/attention.py, e.g. "--sweep" or "--shapes 8b --kinds full").
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="$REPO/bench/results"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

TESTS_TIMEOUT="${TESTS_TIMEOUT:-900}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-1500}"
OTHER_TIMEOUT="${OTHER_TIMEOUT:-900}"
BENCH_ARGS="${BENCH_ARGS:-}"
status=0
note() { printf '\n=== %s  [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }
step() {  # step NAME CMD...: run, report the exit code, remember a failure
  local name="$1"; shift
  "$@"; local rc=$?
  if [ "$rc" -ne 0 ]; then echo "$name FAILED (rc=$rc)"; status=1; fi
}

# ---- pick a python whose torch sees a GPU
if [ -z "${PY:-}" ]; then
  for cand in "$REPO/.venv/bin/python" python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
      PY="$cand"; break
    fi
  done
fi
if [ -n "${PY:-}" ] && command -v "$PY" >/dev/null 2>&1; then
  case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; *) PY="$(command -v "$PY")" ;; esac
else
  echo "no python with a CUDA-enabled torch found (tried .venv/bin/python, python3, python); set PY=..." >&2
  exit 2
fi

# ---- throw-away package tree: dflash_nb + kernels as dflash_nb.kernels
SHADOW="$(mktemp -d "${TMPDIR:-/tmp}/dflash_gpu_check.XXXXXX")"
trap 'rm -rf "$SHADOW"' EXIT
cp -r "$REPO/dflash_nb" "$SHADOW/dflash_nb"
rm -rf "$SHADOW/dflash_nb/kernels"
cp -r "$REPO/kernels" "$SHADOW/dflash_nb/kernels"
export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}"
cd "$SHADOW"   # the working directory is on sys.path for `python -m`: make it the shadow tree, not the checkout

note "1. environment"
step "environment" "$PY" - "$RESULTS/gpu_env.json" <<'EOF'
import json, platform, subprocess, sys
import torch, triton
import dflash_nb, dflash_nb.kernels
info = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
            cuda=torch.version.cuda, device=torch.cuda.get_device_name(0),
            capability=list(torch.cuda.get_device_capability(0)), device_count=torch.cuda.device_count(),
            dflash_nb=dflash_nb.__file__)
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                         "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
except Exception as e:
    info["nvidia_smi"] = f"unavailable: {e}"
print(json.dumps(info, indent=1))
open(sys.argv[1], "w").write(json.dumps(info, indent=1))
EOF

note "2. gpu tests (pytest -m gpu)"
if "$PY" -c "import pytest" 2>/dev/null; then
  step "gpu tests" timeout "$TESTS_TIMEOUT" "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider \
      -c "$REPO/pytest.ini" --rootdir "$REPO" --junitxml "$RESULTS/gpu_tests.xml" "$REPO/tests"
else
  echo "pytest is not installed for $PY: gpu tests NOT run"; status=1
fi

note "3. bench/attention.py"
# shellcheck disable=SC2086  # BENCH_ARGS is deliberately word-split
step "bench/attention.py" timeout "$BENCH_TIMEOUT" "$PY" "$REPO/bench/attention.py" --out "$RESULTS/attention.json" $BENCH_ARGS

note "4. other GPU benches"
others=()
[ -f "$REPO/bench/pipeline.py" ] && others+=("$REPO/bench/pipeline.py")
for f in "$REPO"/bench/*.py; do
  case "$(basename "$f")" in attention.py|pipeline.py|_*|conftest.py) continue ;; esac
  others+=("$f")
done
# run through runpy so that sys.path[0] is the shadow tree, not bench/
for f in "${others[@]}"; do
  note "   $(basename "$f")"
  step "$(basename "$f")" timeout "$OTHER_TIMEOUT" "$PY" -c \
    'import runpy, sys; sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name="__main__")' "$f"
done

note "done: results in $RESULTS (status $status)"
ls -l "$RESULTS"
exit "$status"
