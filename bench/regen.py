"""Regeneration throughput of the two engines on this CPU: completions per second of transformers `generate` in this
process (`HFEngine`, batched) and of vLLM's CPU build in the serving environment (`VLLMEngine`), on the same prompts,
the same target and the same settings (T = 0, float32), measured in one run; the vLLM / HF ratio is printed.

The target is a fixed-seed tiny Qwen3 with head_dim 64 (vLLM's CPU attention refuses less than 32) and the real Qwen3
tokenizer; the prompts are the demo's bundled ones, rendered with thinking off. Per engine: the start (loading the
target / starting the vLLM worker), the generation (the engine's own clock), the check every completion goes through
(`check_completions`: the text round trip, and for HF the batch-1 verification forward), CPU seconds of this process and
its waited-for children, and whether the two engines' tokens are identical.

    python bench/regen.py                         # 137 prompts, 64 new tokens
    python bench/regen.py --prompts 32 --max-new-tokens 16 --out /tmp/regen.json

Writes bench/results/regen.json (or --out).
"""
from __future__ import annotations
import argparse, os, platform, resource, shutil, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = {"hidden_size": 64, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "head_dim": 64,
          "intermediate_size": 128, "seed": 1}   # dflash_nb.target.tiny_target's arguments


def cpu_s() -> float:
    "CPU seconds (user + sys) of this process and of its children that have been waited for."
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def write_target(out: Path) -> Path:
    from dflash_nb.records import qwen3_tokenizer_dir
    from dflash_nb.target import tiny_target
    tiny_target(**TARGET).save_pretrained(out)
    for f in qwen3_tokenizer_dir().iterdir():
        if f.is_file(): shutil.copy(f, out / f.name)
    return out


def measure(kind: str, target_dir: Path, convs: list, max_new_tokens: int, batch_size: int) -> dict:
    "One engine over the prompts: start, warm-up, generate, check; seconds, CPU seconds, rates, the tokens generated."
    from dflash_nb.records import DataConfig, load_tokenizer
    from dflash_nb.regen import CompletionCheck, check_completions, end_ids, generate, generation_config, open_engine
    check = CompletionCheck(load_tokenizer(target_dir), DataConfig(enable_thinking=False),
                            end_ids(generation_config(target_dir)))
    c0, t0 = cpu_s(), time.perf_counter()
    with open_engine(kind, target_dir, check.pad, "float32", "cpu", batch_size) as (engine, verify):
        t_start = time.perf_counter() - t0
        generate(engine, check, convs[:2], 2)          # first-call costs (allocations, thread pools) left out
        t1 = time.perf_counter()
        ids, outs, gen_s = generate(engine, check, convs, max_new_tokens)
        t2 = time.perf_counter()
        _, stats = check_completions(check, convs, ids, outs, verify)
        t3 = time.perf_counter()
    c1 = cpu_s()   # after close: the vLLM worker has been waited for
    n = len(convs)
    return {"engine": kind, "start_s": round(t_start, 2), "generate_s": round(gen_s, 2),
            "generate_wall_s": round(t2 - t1, 2), "check_s": round(t3 - t2, 2), "cpu_s": round(c1 - c0, 1),
            "completions_per_s": round(n / gen_s, 2), "completions_per_s_with_check": round(n / (t3 - t1), 2),
            "tokens_per_s": round(sum(map(len, outs)) / gen_s, 1), "verified": verify is not None, "stats": stats,
            "_outputs": outs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=137, help="the first N bundled prompts (137: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="HF engine: prompts per generate() call")
    ap.add_argument("--hf-threads", type=int, default=1,
                    help="HF engine: torch threads (1: on a loaded 2-core machine two threads were ~10x slower)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "regen.json"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from dflash_nb.regen import read_prompts
    from dflash_nb.train import demo_data_dir
    convs = read_prompts(demo_data_dir() / "prompts.jsonl")[: a.prompts]
    load = os.getloadavg()
    import torch
    torch.set_num_threads(a.hf_threads)       # this process: the HF engine; the vLLM worker picks its own
    with tempfile.TemporaryDirectory(prefix="bench-regen-") as d:
        target = write_target(Path(d) / "target")
        runs = {k: measure(k, target, convs, a.max_new_tokens, a.batch_size) for k in ("hf", "vllm")}
    hf, vl = runs["hf"], runs["vllm"]
    same = sum(x == y for x, y in zip(hf.pop("_outputs"), vl.pop("_outputs")))
    ratio = vl["completions_per_s"] / hf["completions_per_s"]
    ratio_check = vl["completions_per_s_with_check"] / hf["completions_per_s_with_check"]
    res = {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in load],
           "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "target": TARGET, "dtype": "float32",
           "prompts": len(convs), "max_new_tokens": a.max_new_tokens, "hf_batch_size": a.batch_size,
           "hf_threads": a.hf_threads, "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
           "identical_completions": same, "runs": runs, "vllm_over_hf_completions_per_s": round(ratio, 2),
           "vllm_over_hf_with_check": round(ratio_check, 2)}
    write_json(a.out, res)
    for r in (hf, vl):
        print(f"{r['engine']:>5}: start {r['start_s']:6.1f} s  generate {r['generate_s']:6.1f} s "
              f"({r['completions_per_s']:.2f} completions/s, {r['tokens_per_s']:.0f} tokens/s)  "
              f"check {r['check_s']:.1f} s  CPU {r['cpu_s']:.0f} s")
    print(f"vLLM / HF: {ratio:.2f}x completions per second of generation, {ratio_check:.2f}x with the check; "
          f"{same}/{len(convs)} completions identical; load average at start {load[0]:.1f} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
