"""Peak memory of `dflash-regen` against the size of the prompt set: the console script (HF engine, the fixed-seed tiny
target with the real Qwen3 tokenizer) on N distinct short prompts, 1 new token each, shards of 500; its peak resident
set size (the kernel's ru_maxrss of the waited-for child) per N. Results are held a shard at a time, so the peak should
not follow N: only the prompts themselves (a few hundred bytes each) and their de-duplication keys are held for the
whole run.

    python bench/regen_memory.py                       # N = 1000, 5000, 20000
    python bench/regen_memory.py --sizes 1000 2000 --out /tmp/m.json

Writes bench/results/regen-memory.json (or --out).
"""
from __future__ import annotations
import argparse, json, os, platform, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import now_iso, run_child, write_json  # noqa: E402
from regen import write_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(target: Path, prompts: Path, n: int, out: Path) -> dict:
    "One dflash-regen run in a fresh process: its wall time and peak RSS (MiB)."
    cmd = [str(Path(sys.executable).with_name("dflash-regen")), "--target", str(target), "--prompts", str(prompts),
           "--out", str(out), "--max-prompts", str(n), "--max-new-tokens", "1", "--shard-size", "500",
           "--batch-size", "100", "enable_thinking=false"]
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        # this child's own rusage: its own peak RSS
        rc, wall, usage = run_child(cmd, stdout=so, stderr=se, text=True, env={**os.environ, "DFLASH_PROGRESS": "off"})
        so.seek(0), se.seek(0)
        stdout, stderr = so.read(), se.read()
    if rc: raise SystemExit(stderr[-2000:])
    return {"prompts": n, "seconds": round(wall, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "summary": stdout.strip().splitlines()[-2:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "regen-memory.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash_nb-regen-memory-") as d:
        d = Path(d)
        target = write_target(d / "target")
        prompts = d / "prompts.jsonl"
        with open(prompts, "w") as f:
            for i in range(max(a.sizes)):
                f.write(json.dumps({"prompt": f"Question {i}: what is {i} plus {i % 97}?"}) + "\n")
        rows = []
        for n in sorted(a.sizes):
            rows.append(run(target, prompts, n, d / f"out-{n}"))
            print(json.dumps(rows[-1]), flush=True)
    peaks = [r["peak_rss_mib"] for r in rows]
    res = {"bench": "regen_memory", "when": now_iso(), "machine": platform.node(), "cpus": os.cpu_count(),
           "load_average": os.getloadavg(), "runs": rows,
           "peak_rss_ratio_largest_to_smallest": round(peaks[-1] / peaks[0], 3)}
    write_json(a.out, res)
    print(f"peak RSS {peaks[0]:.0f} MiB at {rows[0]['prompts']:,} prompts -> {peaks[-1]:.0f} MiB at "
          f"{rows[-1]['prompts']:,} (x{res['peak_rss_ratio_largest_to_smallest']})")


if __name__ == "__main__":
    main()
