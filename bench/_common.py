"""What the benches share: one JSON writer (`dflash_nb.storage`'s atomic one), one timestamp, the trainer's own step.

A bench that times a training step runs `dflash_nb.trainer.train_step` (and through it `step_loss` with the config's
loss, D-PACE by default) on a `Run` set up here the way `build_run` sets it up, so a bench times the recipe the trainer
runs and has no copy of the step to drift from it.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# an absolute path of two parts or more, not inside a word, a URL (`https://a/b`), a relative or a home path
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.+@~-]+/)+[\w.+@~-]*")


def now_iso() -> str:
    "UTC now as 2026-01-31T12:00:00Z: the timestamp every bench JSON carries."
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _machine_free(match: re.Match) -> str:
    "One absolute path: relative to the repository when inside it, else `.../` and its last two parts."
    path = match.group(0).rstrip("/")
    if path == str(REPO) or path.startswith(f"{REPO}/"): return path[len(str(REPO)) + 1:] or "."
    parts = path.strip("/").split("/")
    return path if len(parts) < 2 else ".../" + "/".join(parts[-2:])       # `/tmp/` says nothing of a machine


def portable(obj):
    "`obj` with no path of the machine it ran on: every absolute path in its strings made relative or cut short."
    if isinstance(obj, dict): return {portable(k): portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)): return [portable(v) for v in obj]
    if isinstance(obj, Path): obj = str(obj)
    return _ABSOLUTE_PATH.sub(_machine_free, obj) if isinstance(obj, str) else obj


def write_json(path, obj, indent: int = 1) -> Path:
    "Write `portable(obj)` as JSON to `path` atomically and durably (`dflash_nb.storage.atomic_write_text`)."
    from dflash_nb.storage import atomic_write_text
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(portable(obj), indent=indent, default=str) + "\n")
    return path


def run_child(cmd, **popen):
    "Run `cmd` to its end: (exit status, wall seconds, the child's own rusage from os.wait4: CPU seconds, peak RSS)."
    import os
    import subprocess
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, **popen)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.perf_counter() - t0, usage


def sync(dev):
    "Wait for the device (a no-op on CPU), so wall-clock intervals hold the device's work."
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best_seconds(fn, repeats: int, dev=None) -> float:
    "The least wall seconds of `fn()` over `repeats` runs (device synchronised): the cost without interference."
    best = float("inf")
    for _ in range(repeats):
        if dev is not None:
            sync(dev)
        t = time.perf_counter()
        fn()
        if dev is not None:
            sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def matmul_tflops(dev, n: int, dtype, repeats: int) -> float:
    "The device's matmul rate measured here: (n x n) @ (n x n) in `dtype`, best of `repeats` after a warm-up."
    import torch
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    a @ b
    return 2 * n ** 3 / best_seconds(lambda: a @ b, repeats, dev) / 1e12


class Batches:
    "The producer `train_step` reads from, over batches prepared in advance (features attached): `get`, `depth`."
    def __init__(self, batches):
        self.batches, self.i = list(batches), 0

    def get(self):
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b

    def depth(self) -> int:
        return 0


def with_features(batch, features, dev):
    "A copy of host `batch` with its tensors on `dev` and the target `features` attached (what the producer hands on)."
    import copy
    b = copy.copy(batch)
    for key, val in batch.tensors().items():
        setattr(b, key, val.to(dev))
    b.features = features.to(dev)
    return b


def trainer_run(cfg, drafter, drafter_cfg, features, dev, backend: str, backend_why: str = ""):
    "A `Run` with what `train_step` reads, set up as `build_run` does (AdamW, schedule, lm_head) for a built drafter."
    import torch
    from dflash_nb import trainer
    from dflash_nb.build import drafter_lm_head_weight
    from dflash_nb.parallel import Layout
    from dflash_nb.train_config import lr_factor
    params = [p for p in drafter.parameters() if p.requires_grad]
    fused, o = trainer._fused_ok(dev), cfg.optim
    opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.steps, o.warmup_frac, o.min_lr_frac))
    none = dict(run_dir=None, ckpt_root=None, log=None, tokenizer=None, samples=None, stream=None, data_id=0,
                target=features.model, log_prefix="")
    return trainer.Run(cfg=cfg, rank=0, world=1, layout=Layout(), distributed=False, target_device=features.device,
                       drafter_device=dev, accum=1, drafter_cfg=drafter_cfg, features=features, drafter=drafter,
                       model=drafter, params=params, fused=fused, optimizer=opt, scheduler=sched,
                       lm_head_w=drafter_lm_head_weight(drafter, features, dev), backend=backend,
                       backend_why=backend_why, **none)


def train_steps(run, producer, n: int, warmup: int = 0, each: bool = True) -> list[float]:
    "Wall seconds of `train_step` after `warmup` untimed steps: each of `n` steps (synced around each), or the window."
    from dflash_nb.metrics import Metrics, Stopwatch
    from dflash_nb.trainer import train_step
    dev = run.drafter_device
    metrics, clock, times = Metrics(dev, run.block_size), Stopwatch(dev), []
    for step in range(warmup + n):
        if each or step == warmup:     # one device: a sync mid-window would stall the producer's stream too
            sync(dev)
            t = time.perf_counter()
        train_step(run, producer, metrics, clock, step)
        if each:
            sync(dev)
            times.append(time.perf_counter() - t)
    if not each:
        sync(dev)
        times.append(time.perf_counter() - t)
    return times[warmup:] if each else times
