"""The GPU check's step record (its JSON, clock and deadline) and the device helpers every phase uses."""
from __future__ import annotations

import time
import traceback
from pathlib import Path

from _common import now_iso, sync, write_json   # noqa: F401  (sync: re-exported for the phases)


def short_error(e: BaseException, n=400):
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:n]}{'...' if len(msg) > n else ''}"


class Record:
    "The JSON of one step, rewritten atomically after every measurement, with the step's own clock and deadline."
    def __init__(self, step, out, deadline_s, dry_run):
        self.t0, self.deadline_s, self.out = time.monotonic(), float(deadline_s), Path(out)
        self.data = dict(step=step, dry_run=dry_run, complete=False, started=now_iso(), deadline_s=self.deadline_s,
                         wall_s=0.0, headline="", skipped=[], errors=[])
        self.save()

    def __getitem__(self, k): return self.data[k]
    def __setitem__(self, k, v): self.data[k] = v
    def update(self, **kw): self.data.update(kw)

    def elapsed(self): return time.monotonic() - self.t0
    def left(self): return self.deadline_s - self.elapsed()

    def fits(self, what, need_s):
        "True if `need_s` more seconds fit before the deadline; otherwise note `what` as skipped and return False."
        if self.left() >= need_s:
            return True
        self.skip(what, f"does not fit: needs ~{need_s:.0f} s, {max(self.left(), 0):.0f} s left of this step's "
                        f"{self.deadline_s:.0f} s")
        return False

    def skip(self, what, why):
        self.data["skipped"].append(dict(what=what, why=why))
        print(f"  skipped {what}: {why}", flush=True)
        self.save()

    def error(self, what, e):
        self.data["errors"].append(dict(what=what, error=short_error(e), traceback=traceback.format_exc()[-2000:]))
        print(f"  ERROR {what}: {short_error(e)}", flush=True)
        self.save()

    def save(self):
        self.data["wall_s"] = round(self.elapsed(), 2)
        write_json(self.out, self.data)

    def finish(self, headline):
        self.data["headline"], self.data["complete"], self.data["finished"] = headline, True, now_iso()
        self.save()
        print(f"  {headline}", flush=True)


def device_for(dry_run):
    import torch
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run the GPU check on a GPU machine, or use --dry-run")
    return torch.device("cuda")


def allow_recompiles():
    "flex is compiled once per shape and mask kind; a check compiles more variants than dynamo's default limit allows."
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def peak_reset(dev):
    "Start a CUDA peak-memory window (after freeing the cache); a no-op on CPU."
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(dev):
    "GiB allocated at the peak of the window `peak_reset` started (None on CPU)."
    import torch
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None
