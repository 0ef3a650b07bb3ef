"""Peak memory and time of the chunked block loss vs the naive (all logits at once) one, forward + backward.

Target shape: 512 anchors × 16 slots × 151,936 vocabulary × hidden 4096, bf16 on GPU.

How peak memory is measured, honestly:
* GPU: `torch.cuda.max_memory_allocated()` minus the memory allocated before the loss (inputs: hidden, lm_head, labels),
  after `reset_peak_memory_stats()`: the caching allocator's own count of live tensor bytes.
* CPU: torch has no CPU allocator statistics and tracemalloc does not see torch's buffers, so each variant runs in a
  fresh subprocess and we read the process's resident-set high-water mark (`VmHWM` in /proc/self/status, reset through
  /proc/self/clear_refs right before the loss so that setup transients do not count; `ru_maxrss` where that reset is not
  allowed, which then also counts the setup). Reported: peak minus the RSS just before the loss, i.e. what the loss
  itself added on top of its inputs, plus the raw process peak. The children run with MALLOC_MMAP_THRESHOLD_=1 MiB,
  so glibc serves every buffer ≥ 1 MiB with mmap and returns it on free: the high-water mark tracks the bytes live at
  once.
Criterion: chunked peak (above inputs) ≤ 1/4 of naive peak (above inputs), for both chunked variants
(`recompute=True`, the default, and `recompute=False`, which computes ∂hidden in forward for a frozen lm_head).

Default CPU scaling (24 GB, 2-core box shared with others): anchors 512 → 128 (÷4) and hidden 4096 → 1024 (÷4), fp32;
slots (16) and vocabulary (151,936) are real. The naive peak grows linearly with the anchors while the chunked one is
fixed by `chunk_blocks`. The default chunk is block_loss's own (`auto_chunk_blocks`: 55 blocks = 512 MiB of fp32
logits for B = 16, V = 151,936) scaled with the anchors (128/512 × 55 → 14 blocks), so the scaled run has the same
number of chunks (~9) as the default at full scale and the ratio carries over. On a GPU it runs the full shape in bf16
with the real default.

Usage: python bench/loss.py [--anchors N] [--hidden H] [--vocab V] [--block B] [--chunk-blocks C] [--dtype fp32|bf16]
                            [--device cpu|cuda] [--out bench/results/loss.json]
"""
from __future__ import annotations
import sys
from pathlib import Path
import argparse, json, os, platform, resource, subprocess, time
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# naive: all logits at once; chunked: block_loss default (backward recomputes each chunk's logits);
# chunked_grad_in_fwd: block_loss(recompute=False), ∂hidden computed in forward (frozen lm_head), one GEMM fewer
VARIANTS = ["naive", "chunked", "chunked_grad_in_fwd"]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f: f.write("5")
        return True
    except OSError:
        return False


def child(a) -> dict:
    "Run one variant once (after a small warm-up) and return its peak memory and time."
    import torch
    sys.path.insert(0, str(ROOT))
    from dflash_nb.loss import block_loss, naive_block_loss
    torch.manual_seed(0)
    dev = torch.device(a.device)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    N, B, H, V = a.anchors, a.block, a.hidden, a.vocab
    W = (torch.randn(V, H, device=dev) * 0.02).to(dt)                 # frozen lm_head, as in training
    labels = torch.randint(0, V, (N, B), device=dev)
    valid = torch.rand(N, B, device=dev) < 0.9
    hidden = torch.randn(N * B, H, device=dev).to(dt)
    fn = naive_block_loss if a.variant == "naive" else block_loss
    kw = {} if a.variant == "naive" else {"chunk_blocks": a.chunk_blocks, "recompute": a.variant == "chunked"}

    def step():
        h = hidden.detach().requires_grad_()
        out = fn(h, W, labels, valid, **kw)
        out.loss.backward()
        return out.loss.detach()

    # warm-up on 2 blocks' worth of rows so thread pools / kernels exist without touching the peak much
    fn(hidden[:2 * B].detach().requires_grad_(), W, labels[:2], valid[:2], **kw).loss.backward()
    res = {"variant": a.variant}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        res["seconds"] = time.perf_counter() - t0
        res.update(peak_bytes=torch.cuda.max_memory_allocated() - base, inputs_bytes=base,
                   method="torch.cuda.max_memory_allocated - memory_allocated before the loss")
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        res["seconds_2nd"] = time.perf_counter() - t0
    else:
        import gc
        gc.collect()
        base = _status("VmRSS:")
        reset = _reset_hwm()
        t0 = time.perf_counter()
        loss = step()
        res["seconds"] = time.perf_counter() - t0
        hwm = _status("VmHWM:") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        res.update(peak_bytes=hwm - base, rss_before_loss=base, process_peak_bytes=hwm,
                   method="VmHWM after clear_refs reset - VmRSS before the loss (fresh process)" if reset
                   else "ru_maxrss - VmRSS before the loss (fresh process; includes setup transients)")
    res["loss"] = float(loss)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--anchors", type=int, default=None)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--chunk-blocks", type=int, default=None,
                   help="default: block_loss's own (auto_chunk_blocks) at 512 anchors, scaled with fewer anchors")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--out", default=str(ROOT / "bench/results/loss.json"))
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child mode
    a = p.parse_args(argv)
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = a.device == "cuda"
    a.anchors = a.anchors or (512 if gpu else 128)
    a.hidden = a.hidden or (4096 if gpu else 1024)
    a.dtype = a.dtype or ("bf16" if gpu else "fp32")
    if a.chunk_blocks is None:   # keep the number of chunks of the full-scale default when the anchors are scaled down
        from dflash_nb.loss import auto_chunk_blocks
        a.chunk_blocks = max(1, round(auto_chunk_blocks(a.block, a.vocab) * min(1.0, a.anchors / 512)))
    if a.variant:
        print(json.dumps(child(a)))
        return

    shape = dict(anchors=a.anchors, block=a.block, vocab=a.vocab, hidden=a.hidden, dtype=a.dtype, device=a.device,
                 chunk_blocks=a.chunk_blocks)
    print("shape:", shape)
    results = {}
    variants = [v for v in VARIANTS if v in a.variants.split(",")]
    if variants[:1] != ["naive"] or len(variants) < 2: sys.exit("--variants must include naive and a chunked variant")
    for variant in variants:
        cmd = [sys.executable, __file__, "--variant", variant] + sum(
            ([f"--{k.replace('_', '-')}", str(v)] for k, v in shape.items()), [])
        # glibc: serve every buffer ≥ 1 MiB with mmap (fixed threshold, not the dynamic one that rises after the first
        # large free), so freed buffers leave the RSS at once and the high-water mark is the bytes live at once
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if r.returncode != 0: sys.exit(f"{variant} failed:\n{r.stderr}")
        results[variant] = json.loads(r.stdout.strip().splitlines()[-1])
        res = results[variant]
        print(f"{variant:20s} peak above inputs {res['peak_bytes'] / 2**30:7.3f} GiB   time {res['seconds']:7.2f} s   "
              f"loss {res['loss']:.5f}")
    chunked = variants[1:]
    ratio = max(results[v]["peak_bytes"] for v in chunked) / results["naive"]["peak_bytes"]
    rows, full_rows = a.anchors * a.block, 512 * 16
    logits_bytes = 4 * a.vocab
    summary = dict(
        shape=shape, results=results, peak_ratio_chunked_over_naive=ratio, passes_quarter=ratio <= 0.25,
        peak_ratio_per_variant={v: results[v]["peak_bytes"] / results["naive"]["peak_bytes"] for v in chunked},
        time_ratio_per_variant={v: results[v]["seconds"] / results["naive"]["seconds"] for v in chunked},
        loss_abs_diff=max(abs(results[v]["loss"] - results["naive"]["loss"]) for v in chunked),
        fp32_logits_bytes=dict(naive_all_rows=rows * logits_bytes, chunk=a.chunk_blocks * a.block * logits_bytes,
                               naive_at_full_scale_512x16x151936=full_rows * 4 * 151936),
        scaling=("full shape" if (a.anchors, a.hidden) == (512, 4096) else
                 f"anchors 512→{a.anchors}, hidden 4096→{a.hidden}; slots and vocabulary as given"),
        host=dict(platform=platform.platform(), cpus=os.cpu_count(), python=platform.python_version()),
    )
    print(f"chunked/naive peak ratio {ratio:.3f} (worst chunked variant; criterion ≤ 0.25: "
          f"{'PASS' if ratio <= 0.25 else 'FAIL'}); time ratios "
          + ", ".join(f"{v} {r:.2f}" for v, r in summary["time_ratio_per_variant"].items()))
    write_json(a.out, summary, indent=2)
    print("wrote", a.out)
    return summary


if __name__ == "__main__":
    main()
