"""What the benches share, all of it the library's: the JSON writer and clock of the GPU check (`dflash_nb.gpu_plan`,
chapter 13a), its timing helpers, and the trainer's own step on a `Run` set up as `build_run` does
(`dflash_nb.gpu_target`, chapter 13c), so a bench times the recipe the trainer runs and has no copy to drift from it.
`run_child` (a child's own rusage) is the one helper only the benches use.
"""
from __future__ import annotations

import time
from dflash_nb.gpu_plan import best_seconds, matmul_tflops, now_iso, portable, sync, write_json  # noqa: F401

_TRAINER = ("Batches", "with_features", "trainer_run", "train_steps")


def __getattr__(name):
    "The trainer helpers on first use: importing `dflash_nb.gpu_target` pulls in torch and the trainer."
    if name in _TRAINER:
        from dflash_nb import gpu_target
        return getattr(gpu_target, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_child(cmd, **popen):
    "Run `cmd` to its end: (exit status, wall seconds, the child's own rusage from os.wait4: CPU seconds, peak RSS)."
    import os
    import subprocess
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, **popen)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.perf_counter() - t0, usage
