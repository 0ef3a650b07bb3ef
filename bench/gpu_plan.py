"""The GPU check's one time plan: seconds per step and per part inside a step, the budget; gpu_check.sh reads it here.

    python bench/gpu_plan.py [--dry-run]     # the plan as shell assignments (what gpu_check.sh evaluates)

`step` is the planned seconds of a step (also the least that must be left to start it), `parts` the seconds each part
inside the step keeps before it starts (a part that no longer fits is skipped and recorded under "skipped"). GPU: one
H200, compiles included, set from the last run's wall times (bench/results/gpu_check.json) plus the fla compile for the
target step; dry run: two busy CPU cores.
"""
from __future__ import annotations

import sys

BUDGET_S = 400          # gpu_check.sh's default --budget
RESERVE_S = 5           # kept for the summary
CAP_PERCENT = {False: 150, True: 400}   # a step's time limit, in percent of its plan (the dry run's CPU may be shared)
ORDER = ("env", "parity", "speed", "pipeline", "target", "tp", "sweep", "tests")
OPTIONAL = {   # steps outside the default plan
    "sweep": "runs with --sweep only",
    "tp": "runs with >= 2 CUDA devices only (gpu_check.sh then adds its plan to the default budget)"}

PLAN = {
    False: {   # one H200
        "env": dict(step=15),
        "parity": dict(step=70, parts=dict(reduced=20, narrow_window=20, flagship=30)),
        "speed": dict(step=40, parts=dict(triton=8, flex=15, sdpa=8, auto=20)),
        "pipeline": dict(step=100, parts=dict(I=20, T=40, T_more=30, P=25)),
        "target": dict(step=90, parts=dict(run=20, check=20, dense=30)),
        "tp": dict(step=100, parts=dict(save=20, launch=35)),   # not measured yet: 2 torchrun launches + the save
        "sweep": dict(step=90, parts=dict(kind=20, candidate=8)),
        "tests": dict(step=80, minimum=30),
    },
    True: {    # dry run on CPU
        "env": dict(step=8),   # imports torch, transformers and the package: 5 s of CPU
        "parity": dict(step=8, parts=dict(reduced=1, narrow_window=1, flagship=1)),
        "speed": dict(step=8, parts=dict(triton=1, flex=1, sdpa=1, auto=2)),
        "pipeline": dict(step=12, parts=dict(I=1, T=2, T_more=1, P=2)),
        "target": dict(step=10, parts=dict(run=5, check=2, dense=10)),
        "tp": dict(step=60, parts=dict(save=5, launch=25)),     # two 2-process gloo launches: imports dominate
        "sweep": dict(step=6, parts=dict(kind=1, candidate=0.5)),
        "tests": dict(step=12, minimum=8),
    },
}


def need(step: str, part: str, dry_run: bool) -> float:
    "Seconds the part `part` of step `step` keeps before it starts."
    return PLAN[dry_run][step]["parts"][part]


def default_plan_s(dry_run: bool = False, gpus: int = 1) -> int:
    "Planned seconds of a default run (no --sweep) on `gpus` CUDA devices plus the summary's reserve."
    return sum(v["step"] for k, v in PLAN[dry_run].items()
               if k not in OPTIONAL or (k == "tp" and gpus >= 2)) + RESERVE_S


def shell(dry_run: bool) -> str:
    "Shell assignments: BUDGET_DEFAULT, RESERVE; per step E_ (plan), M_ (least left to start), L_ (time-limit cap)."
    out = [f"BUDGET_DEFAULT={BUDGET_S} RESERVE={RESERVE_S}"]
    for name in ORDER:
        p = PLAN[dry_run][name]
        cap = int(p["step"] * CAP_PERCENT[dry_run] / 100)
        key = name.upper()
        out.append(f"E_{key}={p['step']} M_{key}={p.get('minimum', p['step'])} L_{key}={cap}")
    return "\n".join(out)


if __name__ == "__main__":
    print(shell("--dry-run" in sys.argv[1:]))
