"""The embedded demo on CPU in float32 vs bfloat16 (the target's weights and the drafter's autocast), in one run: wall
time, CPU seconds (user + sys, the number that survives a shared machine), acceptance length τ before/after, and how
many of the target's generated tokens the data kept. The bf16/fp32 ratios are printed and written with the raw numbers.

Variants (overrides of `python -m dflash_nb.train`, the demo config):
  fp32        train.target.dtype=float32 train.amp='off'     (what `auto` means on CPUs without native bf16)
  bf16        train.target.dtype=bfloat16 train.amp=bfloat16 (what `auto` means on CPUs with native bf16, see cpu_bf16)
  fp32_data   the target in float32, the drafter under bf16 autocast: the demo's own setting (configs/demo.yaml pins
              the tiny target to float32: its data in bf16 lose half their tokens), and it separates the data the
              target generates from the drafter's precision
  bf16_nommap bf16 with glibc's mmap of large blocks off (MALLOC_MMAP_MAX_=0): tests whether the kernel time is
              page faults of the large vocabulary-sized buffers

    python bench/cpu_dtype.py                       # fp32, fp32_data, bf16, one after the other, 2 threads each
    python bench/cpu_dtype.py --variants fp32 bf16 fp32_data --threads 1 --jobs 3   # at once: compare CPU seconds

Writes bench/results/cpu_dtype.json (or --out).
"""
from __future__ import annotations
import argparse, json, os, platform, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import best_seconds, run_child, write_json

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "fp32": (["train.target.dtype=float32", "train.amp='off'"], {}),
    "bf16": (["train.target.dtype=bfloat16", "train.amp=bfloat16"], {}),
    "fp32_data": (["train.target.dtype=float32", "train.amp=bfloat16"], {}),
    "bf16_nommap": (["train.target.dtype=bfloat16", "train.amp=bfloat16"],
                    {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}),
}


def run_timed(cmd: list[str], env: dict, log: Path) -> dict:
    "Run `cmd` to completion; wall seconds and the child's user/sys CPU seconds (os.wait4 reports them per child)."
    with open(log, "w") as f:
        rc, wall, ru = run_child(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return {"rc": rc, "wall_s": round(wall, 1), "user_s": round(ru.ru_utime, 1),
            "sys_s": round(ru.ru_stime, 1), "max_rss_gb": round(ru.ru_maxrss / 1e6, 2), "log": str(log)}


def demo(name: str, work: Path, threads: int) -> dict:
    "One full demo run of variant `name`: timings, τ, kept tokens, the precision the trainer reported."
    overrides, extra_env = VARIANTS[name]
    run_dir = work / name
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), **extra_env}
    cmd = [sys.executable, "-m", "dflash_nb.train", f"train.run_dir={run_dir}", *overrides]
    out = run_timed(cmd, env, work / f"{name}.log")
    out.update(variant=name, overrides=overrides, env=extra_env, threads=threads)
    if out["rc"] != 0: return out
    r = json.loads((run_dir / "report.json").read_text())
    s = json.loads((run_dir / "summary.json").read_text())
    log = (work / f"{name}.log").read_text()
    kept = next((l.strip() for l in log.splitlines() if l.strip().startswith("kept ")), "")
    out.update(tau_before=r["tau_before"]["tau"], tau_after=r["tau_after"]["tau"], train_wall_s=round(s["wall_s"], 1),
               precision=s.get("precision"), kept=kept, per_position=r["tau_after"]["per_position"])
    return out


def threads_probe(dtype_name: str = "bfloat16", reps: int = 3) -> dict:
    "Seconds of the demo's hot spots at 1 and 2 threads: the target's generate() and the loss's vocabulary projection."
    # generate(): 160 prompts, 16 new tokens (the demo's batch); projection: 64 block slots x 152K vocabulary (a row)
    import torch
    sys.path.insert(0, str(ROOT))
    from dflash_nb.target import tiny_target
    dt = getattr(torch, dtype_name)
    target = tiny_target(hidden_size=64, num_layers=6, seed=11, initializer_range=0.04, dtype=dt).eval()
    ids = torch.randint(0, 150000, (160, 40))
    h = torch.randn(64, 64, requires_grad=True)
    w = target.lm_head.weight.detach().float()
    out = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        def gen():
            with torch.inference_mode():
                target.generate(input_ids=ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        def proj():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(h @ w.T, torch.randint(0, w.shape[0], (64,)))
            loss.backward()
        for name, fn in (("generate_s", gen), ("loss_projection_s", proj)):
            fn()   # warm-up
            out.setdefault(f"threads_{n}", {})[name] = round(best_seconds(fn, reps), 4)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["fp32", "fp32_data", "bf16"], choices=sorted(VARIANTS))
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run (default: the 2 cores)")
    ap.add_argument("--jobs", type=int, default=1, help="variants run at once (then compare CPU seconds, not wall)")
    ap.add_argument("--threads-probe", action="store_true",
                    help="only time the demo's generation and loss projection at 1 vs 2 threads")
    ap.add_argument("--work", default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_dtype.json"))
    a = ap.parse_args()
    if a.threads_probe:
        res = {"load_avg_at_start": os.getloadavg(), "bfloat16": threads_probe("bfloat16"),
               "float32": threads_probe("float32"),
               "load_avg_at_end": os.getloadavg()}
        print(json.dumps(res, indent=1))
        out = Path(a.out).with_name("cpu_threads.json")
        write_json(out, res)
        print(f"wrote {out}")
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="cpu_dtype-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from dflash_nb.build import cpu_bf16
    t0 = time.time()
    with ThreadPoolExecutor(a.jobs) as pool:
        runs = list(pool.map(lambda v: demo(v, work, a.threads), a.variants))
    res = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_avg_at_start": os.getloadavg(),
           "cpu_bf16": cpu_bf16(), "threads": a.threads, "jobs": a.jobs, "runs": {r["variant"]: r for r in runs}}
    shown = ("variant", "rc", "wall_s", "user_s", "sys_s", "tau_before", "tau_after", "kept")
    for r in runs: print(json.dumps({k: r.get(k) for k in shown}))
    base = res["runs"].get("fp32")
    if base and base["rc"] == 0:
        res["ratio_vs_fp32"] = {v: {k: round(r[k] / base[k], 3) for k in ("wall_s", "user_s", "sys_s") if base[k]}
                                for v, r in res["runs"].items() if r["rc"] == 0 and v != "fp32"}
        for v, q in res["ratio_vs_fp32"].items():
            print(f"{v}/fp32: wall x{q.get('wall_s')}, user x{q.get('user_s')}, sys x{q.get('sys_s')}")
    res["load_avg_at_end"], res["bench_wall_s"] = os.getloadavg(), round(time.time() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, res)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
