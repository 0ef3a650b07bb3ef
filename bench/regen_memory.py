"""Peak memory of `dflash-regen` against the size of the prompt set: the console script (HF engine, the fixed-seed tiny
target with the real Qwen3 tokenizer) on N distinct short prompts, 1 new token each, shards of 500; its peak resident
set size (the kernel's ru_maxrss of the waited-for child) per N. Results are held a shard at a time and the prompts are
spooled to an unlinked temp file, so the peak should not follow N: per prompt only its line's offset and its
de-duplication key stay in memory.

Then the prompt set alone, at a realistic prompt size (--load-prompt-bytes, 2 KB): the Python heap (tracemalloc) and
peak RSS of a fresh process that reads it into a PromptSpool, against the baseline of one that holds it whole as
`read_prompt_file` does (what `dflash-regen` did before it spooled), same file, same run.

    python bench/regen_memory.py                       # N = 1000, 5000, 20000; load: 20000, 100000
    python bench/regen_memory.py --sizes 1000 2000 --load-sizes 5000 --out /tmp/m.json

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


LOAD = """
import json, sys, tracemalloc
from dflash_nb.prompts import read_prompt_file
from dflash_nb.regen import spool_prompts
how, path = sys.argv[1:]
tracemalloc.start()
got = read_prompt_file(path) if how == "whole" else spool_prompts([path])
held, peak = tracemalloc.get_traced_memory()
print(json.dumps({"prompts": len(got), "held_mib": round(held / 2**20, 2), "heap_peak_mib": round(peak / 2**20, 2)}))
"""


def load(prompts: Path, how: str) -> dict:
    "Read the prompt set in a fresh process, held whole or spooled: its heap (held at the end, peak) and peak RSS."
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        rc, wall, usage = run_child([sys.executable, "-c", LOAD, how, str(prompts)], stdout=so, stderr=se, text=True)
        so.seek(0), se.seek(0)
        stdout, stderr = so.read(), se.read()
    if rc: raise SystemExit(stderr[-2000:])
    return {"how": how, **json.loads(stdout), "seconds": round(wall, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def write_prompts(path: Path, n: int, size: int):
    "`n` distinct prompts of about `size` bytes each (words drawn with a fixed seed)."
    import random
    rng, words = random.Random(0), "the of and to in is that for it as was with be by on not this are or from".split()
    with open(path, "w") as f:
        for i in range(n):
            text = f"Question {i}: " + " ".join(rng.choice(words) for _ in range(size // 4))
            f.write(json.dumps({"prompt": text[:size]}) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000])
    ap.add_argument("--load-sizes", type=int, nargs="+", default=[20000, 100000])
    ap.add_argument("--load-prompt-bytes", type=int, default=2000)
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
        loads = []
        for n in sorted(a.load_sizes):
            f = d / "load.jsonl"
            write_prompts(f, n, a.load_prompt_bytes)
            for how in ("whole", "spool"):
                loads.append({"file_mib": round(f.stat().st_size / 2**20, 1), **load(f, how)})
                print(json.dumps(loads[-1]), flush=True)
    peaks = [r["peak_rss_mib"] for r in rows]
    res = {"bench": "regen_memory", "when": now_iso(), "machine": platform.node(), "cpus": os.cpu_count(),
           "load_average": os.getloadavg(), "runs": rows,
           "peak_rss_ratio_largest_to_smallest": round(peaks[-1] / peaks[0], 3),
           "load": loads, "load_heap_held_ratio_spool_to_whole": [
               round(s["held_mib"] / w["held_mib"], 4) for w, s in zip(loads[::2], loads[1::2])]}
    write_json(a.out, res)
    print(f"peak RSS {peaks[0]:.0f} MiB at {rows[0]['prompts']:,} prompts -> {peaks[-1]:.0f} MiB at "
          f"{rows[-1]['prompts']:,} (x{res['peak_rss_ratio_largest_to_smallest']})")
    for w, sp in zip(loads[::2], loads[1::2]):
        print(f"{w['prompts']:,} prompts of {a.load_prompt_bytes} B ({w['file_mib']} MiB): held whole "
              f"{w['held_mib']} MiB of heap (RSS {w['peak_rss_mib']}), spooled {sp['held_mib']} MiB "
              f"(RSS {sp['peak_rss_mib']}): "
              f"x{sp['held_mib'] / w['held_mib']:.4f}")


if __name__ == "__main__":
    main()
