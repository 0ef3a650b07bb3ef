"""Forward + backward time of anchor-block attention: Triton kernel vs compiled flex_attention vs SDPA (dense mask).

Shapes (one packed row, DFlash drafter attention): S = 8192 context tokens (--seq-len), 512 anchors (--anchors), block
size B = 16 (N*B = 8192 queries, S + N*B = 16384 keys), in several documents, for
  * Qwen3-8B drafter:    32 query heads, 8 kv heads, head_dim 128
  * Qwen3.6-27B drafter: 24 query heads, 4 kv heads, head_dim 256 (the target's gated-attention layout per the
    Qwen3.6-27B model card: "Attention Heads: Q 24, KV 4; Head Dimension 256")
and two layer kinds: full (context = document prefix) and sliding (window 2048, causal inside the block).
Every backend runs through the public call `dflash_nb.attention.anchor_block_attention(..., backend=name)` on one
shared `AnchorBlockLayout`, so the masks are the project's own (the dense mask, BlockMask and context ranges).

Reported per (shape, kind, backend): ms forward, ms forward+backward (median of CUDA-event timings), useful TFLOP/s
(only the visible (query, key) pairs of the dense mask count: fwd 4*pairs*D*H FLOPs, bwd 10*pairs*D*H, i.e. 2 and 5
matmuls), peak memory above inputs, max |out - sdpa out|, and the ratios triton/flex and triton/sdpa as speed-ups
(other time / triton time, > 1 means triton is faster). For the Triton kernel, the shared memory of every launched
config as the compiled kernel's metadata reports it, and the ahead-of-time compiled shared memory for sm_90 and sm_120
of every table entry. Targets on H200: triton fwd+bwd >= 1.0x flex (goal 1.2x) and >= 3x sdpa; every config <=
101,376 B.

Without a GPU: says so, runs a tiny interpreter smoke test of the kernel and exits 0 without writing results.
bench/gpu_check.py reuses the helpers below (layout, backends, timing, sweep) for the short GPU check.

Usage: python bench/attention.py [--out bench/results/attention.json] [--shapes 8b,27b] [--kinds full,sliding]
                                 [--backends triton,flex,sdpa] [--iters 10] [--seq-len 8192] [--anchors 512] [--sweep]
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from _common import now_iso, write_json

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # name: (q heads, kv heads, head_dim)
    "8b": (32, 8, 128),
    "27b": (24, 4, 256),
}
KINDS = {"full": (None, False), "sliding": (2048, True)}  # (window, causal_in_block)
S_CTX, N_ANCHORS, BLOCK = 8192, 512, 16
N_DOCS = 6


def packed_layout(device, seed=0, S=S_CTX, N=N_ANCHORS, B=BLOCK, docs=N_DOCS):
    "A packed row of `docs` documents (random lengths summing to S) and N anchors drawn by the real sampler."
    from dflash_nb.anchors import sample_anchors

    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(S - 1, generator=g)[: docs - 1] + 1).values.tolist()
    bounds = [0] + cuts + [S]
    doc_ids = torch.cat([torch.full((bounds[i + 1] - bounds[i],), i) for i in range(docs)])
    loss_mask = torch.ones(S, dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, doc_ids, B, N, generator=g)
    return anchors.to(device), keep.to(device), doc_ids.to(device)


def attention_inputs(dev, c, seed=0):
    "A packed row (real anchor sampler), its AnchorBlockLayout, and bf16 q, k, v, dout of shape c (H, HKV, D, S, N, B)."
    from dflash_nb.attention import AnchorBlockLayout
    anchors, keep, doc_ids = packed_layout(dev, seed=seed, S=c["S"], N=c["N"], B=c["B"], docs=c["docs"])
    layout = AnchorBlockLayout(anchors, keep, doc_ids, c["B"])
    g = torch.Generator(device=dev).manual_seed(seed)
    NB, KV = c["N"] * c["B"], c["S"] + c["N"] * c["B"]
    random_heads = lambda h, n: torch.randn(1, h, n, c["D"], device=dev, generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, k = random_heads(c["H"], NB), random_heads(c["HKV"], KV)             # drawn in this order: q, k, v, dout
    v, dout = random_heads(c["HKV"], KV), random_heads(c["H"], NB)
    return layout, q, k, v, dout


def add_speedups(run):
    "Triton's speed-up over flex and sdpa (other ms / triton ms), forward and forward+backward, where both were timed."
    b = run["backends"]
    for mode in ("fwd", "fwd_bwd"):
        tri = b.get("triton", {}).get(f"ms_{mode}")
        for other in ("flex", "sdpa"):
            o = b.get(other, {}).get(f"ms_{mode}")
            if tri and o:
                run[f"speedup_triton_vs_{other}_{mode}"] = o / tri


def visible_pairs(layout, window, causal):
    "Visible (query, key) pairs per head: the True entries of the project's dense mask of this kind."
    return int(layout.dense_mask(window, causal).sum())


def useful_flops(pairs, H, D):
    "(forward, backward) FLOPs of the visible pairs: QK^T and PV forward (2 matmuls), 5 matmuls backward."
    return 4 * pairs * D * H, 10 * pairs * D * H


def cuda_time(fn, iters, warmup=3):
    "Median milliseconds of fn() over iters CUDA-event-timed runs."
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def host_time(fn, iters, warmup=0):
    "Median milliseconds of fn() over iters wall-clock runs (CPU dry runs)."
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def make_backends(layout, window, causal):
    "name -> attention(q, k, v) through the public call; the layout caches each backend's mask structure once."
    from dflash_nb.attention import anchor_block_attention

    def backend(name):
        return lambda q, k, v: anchor_block_attention(q, k, v, window=window, causal_in_block=causal, backend=name,
                                                      layout=layout)
    return {name: backend(name) for name in ("triton", "flex", "sdpa")}


def bench_one(fn, q, k, v, g, iters, backward=True):
    "Time forward (and forward+backward); return dict with ms, peak memory (CUDA) and the output."
    cuda = q.device.type == "cuda"
    timer = cuda_time if cuda else host_time
    qq, kk, vv = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return fn(qq, kk, vv)

    def fwd_bwd():
        qq.grad = kk.grad = vv.grad = None
        o = fn(qq, kk, vv)
        o.backward(g)

    out = fwd()  # compiles / autotunes
    res = {}
    if backward:
        fwd_bwd()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd() if backward else fwd()
        torch.cuda.synchronize()
        res["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    res["ms_fwd"] = timer(fwd, iters)
    if backward:
        res["ms_fwd_bwd"] = timer(fwd_bwd, iters)
    return res, out


def aot_smem():
    "Shared memory, registers and spills of every table config compiled ahead of time for sm_90 and sm_120."
    from dflash_nb.kernels.anchor_attention import CONFIGS, compile_for_target, ptxas_stats
    rows = []
    for (d, esize), kinds in CONFIGS.items():
        dtype = torch.float32 if esize == 4 else torch.bfloat16
        for kind in kinds:
            for cap in (90, 120):
                try:
                    c = compile_for_target(kind, d, dtype, cap)
                    try:
                        st = ptxas_stats(c, cap)
                    except Exception as e:  # ptxas layout differs in another Triton release
                        st = dict(ptxas_error=f"{type(e).__name__}: {e}"[:200])
                    rows.append(dict(kernel=kind, head_dim=d, dtype=str(dtype)[6:], capability=cap,
                                     shared_bytes=int(c.metadata.shared), **st))
                except Exception as e:  # e.g. an older Triton without this target
                    rows.append(dict(kernel=kind, head_dim=d, dtype=str(dtype)[6:], capability=cap,
                                     error=f"{type(e).__name__}: {e}"[:300]))
    return rows


SWEEP = {  # candidate (block_m, block_n, warps, stages) per head_dim for --sweep; smem-checked before running.
    # The table was chosen without a GPU (fits, no spills, largest tiles); these add the close alternatives: larger
    # tiles that fit only narrowly or spill a little on sm_120 but might be faster on Hopper, and smaller ones.
    128: [(128, 32, 8, 3), (64, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 8, 2), (128, 64, 8, 2)],
    256: [(64, 32, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (32, 32, 8, 1), (16, 32, 8, 1), (64, 32, 4, 2)],
    32: [(16, 16, 4, 1)],  # tiny head dim: only for the CPU dry run of the sweep, in the interpreter
}


def sweep(q, k, v, g, fn, D, iters, record, time_left=None, need_s=0.0, aot=True):
    """Time each candidate config per kernel (others at the table default); shared memory from AOT and launch.

    With `time_left` (a callable returning seconds), candidates are skipped once fewer than `need_s` seconds remain;
    `aot=False` leaves out the ahead-of-time compiles for sm_90/sm_120 (ptxas; slow on a CPU)."""
    from dflash_nb.kernels.anchor_attention import LAUNCHED, SMEM_LIMIT, TileConfig, compiled_smem, override_configs
    res = {}  # LAUNCHED keys: (kernel, head_dim, dtype, BLOCK_M, BLOCK_N, warps, stages, capability)
    for kind in ("fwd", "dq", "dkdv"):
        rows = []
        for c in SWEEP.get(D, []):
            cfg = TileConfig(*c)
            row = dict(config=c)
            if time_left is not None and time_left() < need_s:
                row["skipped"] = f"out of time ({time_left():.0f} s left, one candidate needs ~{need_s:.0f} s)"
                rows.append(row)
                continue
            try:
                if aot:
                    row.update({f"aot_smem_sm{x}": compiled_smem(kind, D, q.dtype, x, cfg=cfg) for x in (90, 120)})
            except Exception as e:  # AOT API of another Triton release: rely on the launched metadata below
                row["aot_error"] = f"{type(e).__name__}: {e}"[:200]
            if max([v_ for k_, v_ in row.items() if k_.startswith("aot_smem")] or [0]) > SMEM_LIMIT:
                row["skipped"] = "over SM120 shared memory"
                rows.append(row)
                continue
            try:
                with override_configs(**{kind: cfg}):
                    t, _ = bench_one(fn, q, k, v, g, iters)
                row.update(t)
                launched = [s_ for key, s_ in LAUNCHED.items() if key[0] == kind and key[1] == D and key[3:7] == c]
                row["launched_smem"] = max(launched) if launched else None
                # no launch metadata on CPU (interpreter): unknown, not a failure
                row["fits_sm120"] = None if q.device.type == "cpu" else bool(launched) and max(launched) <= SMEM_LIMIT
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
        ok = [r for r in rows if "ms_fwd_bwd" in r and r.get("fits_sm120") is not False]
        res[kind] = dict(candidates=rows, best=min(ok, key=lambda r: r["ms_fwd_bwd"])["config"] if ok else None)
        record(res)
    return res


def gpu_main(args):
    from dflash_nb.kernels.anchor_attention import LAUNCHED, SMEM_LIMIT, pick_config
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    import triton
    result = dict(device=props.name, capability=list(torch.cuda.get_device_capability(dev)),
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  smem_limit_bytes=SMEM_LIMIT, S=args.seq_len, anchors=args.anchors, block_size=BLOCK, docs=N_DOCS,
                  dtype="bfloat16", started=now_iso(), runs=[])
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def in_table(key):  # a config of the shipped table (not a --sweep candidate)
        cfg, _ = pick_config(key[0], key[1], getattr(torch, key[2]), BLOCK)
        return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == tuple(key[3:7])

    def save():  # after every measurement, so a timeout still leaves what was measured
        result["launched_smem"] = [dict(kernel=k[0], head_dim=k[1], dtype=k[2], block_m=k[3], block_n=k[4],
                                        num_warps=k[5], num_stages=k[6], capability=k[7], shared_bytes=v,
                                        fits_sm120=v <= SMEM_LIMIT, in_table=in_table(k))
                                   for k, v in LAUNCHED.items()]
        write_json(out_path, result)

    S, N, NB = args.seq_len, args.anchors, args.anchors * BLOCK
    for shape in args.shapes.split(","):
        H, HKV, D = SHAPES[shape]
        layout, q, k, v, g = attention_inputs(dev, dict(H=H, HKV=HKV, D=D, S=S, N=N, B=BLOCK, docs=N_DOCS))
        for kind in args.kinds.split(","):
            window, causal = KINDS[kind]
            fns = make_backends(layout, window, causal)
            pairs = visible_pairs(layout, window, causal)
            flops_fwd, flops_bwd = useful_flops(pairs, H, D)
            run = dict(shape=shape, heads=H, kv_heads=HKV, head_dim=D, kind=kind, window=window,
                       causal_in_block=causal, visible_pairs_per_head=pairs,
                       density=pairs / (NB * (S + NB)), backends={})
            result["runs"].append(run)
            outs = {}
            for name in args.backends.split(","):
                t0 = time.time()
                try:
                    r, outs[name] = bench_one(fns[name], q, k, v, g, args.iters)
                    r["tflops_fwd"] = flops_fwd / r["ms_fwd"] / 1e9
                    r["tflops_fwd_bwd"] = (flops_fwd + flops_bwd) / r["ms_fwd_bwd"] / 1e9
                except Exception as e:
                    r = dict(error=f"{type(e).__name__}: {e}"[:1000], traceback=traceback.format_exc()[-3000:])
                r["wall_s"] = round(time.time() - t0, 1)
                run["backends"][name] = r
                print(f"[{shape} {kind}] {name}: " + ", ".join(
                    f"{k_}={v_:.3f}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in r.items()
                    if k_ != "traceback"), flush=True)
                save()
            ref = outs.get("sdpa")
            for name, o in outs.items():
                if ref is not None and name != "sdpa":
                    run["backends"][name]["max_abs_diff_vs_sdpa"] = (o.float() - ref.float()).abs().max().item()
            add_speedups(run)
            if args.sweep and "triton" in fns:
                def rec(res, run=run):
                    run["sweep"] = res
                    save()
                sweep(q, k, v, g, fns["triton"], D, args.iters, rec)
            save()
            del outs
            torch.cuda.empty_cache()
    result["aot_smem"] = aot_smem()
    launched = [r for r in result.get("launched_smem", []) if r["in_table"]]
    result["all_table_configs_fit_sm120"] = all(r["fits_sm120"] for r in launched) if launched else None
    result["finished"] = now_iso()
    save()
    print(f"wrote {out_path}")
    for run in result["runs"]:
        print(f"{run['shape']:>4} {run['kind']:<8} " + "  ".join(
            f"{n}: {r.get('ms_fwd_bwd', float('nan')):.2f} ms" for n, r in run["backends"].items()) +
            "  triton speed-up vs flex {:.2f}x, vs sdpa {:.2f}x".format(
                run.get("speedup_triton_vs_flex_fwd_bwd", float("nan")),
                run.get("speedup_triton_vs_sdpa_fwd_bwd", float("nan"))))
    return 0


def cpu_smoke():
    "Tiny interpreter run of the kernel (forward + backward) against plain torch, so the script is exercised on CPU."
    from dflash_nb.attention import AnchorBlockLayout, anchor_block_attention
    doc_ids = torch.tensor([0] * 20 + [1] * 12)
    anchors, keep = torch.tensor([0, 5, 19, 22, 0]), torch.tensor([True, True, True, True, False])
    B, H, HKV, D = 4, 4, 2, 32
    layout = AnchorBlockLayout(anchors, keep, doc_ids, B)
    mask = layout.dense_mask()
    q = torch.randn(1, H, 5 * B, D, requires_grad=True)
    k = torch.randn(1, HKV, 32 + 5 * B, D, requires_grad=True)
    v = torch.randn(1, HKV, 32 + 5 * B, D, requires_grad=True)
    t0 = time.time()
    o = anchor_block_attention(q, k, v, backend="triton", layout=layout)
    o.sum().backward()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = torch.softmax(((q @ kk.transpose(-1, -2)) / math.sqrt(D)).masked_fill(~mask, float("-inf")), -1) @ vv
    err = (o - ref).abs().max().item()
    print(f"interpreter smoke run: max |triton - torch| = {err:.2e} ({time.time() - t0:.1f} s)")
    return err < 1e-4


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention.json"))
    p.add_argument("--shapes", default="8b,27b")
    p.add_argument("--kinds", default="full,sliding")
    p.add_argument("--backends", default="triton,flex,sdpa")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=S_CTX, help="context tokens S of the packed row")
    p.add_argument("--anchors", type=int, default=N_ANCHORS, help="anchor slots N of the packed row")
    p.add_argument("--sweep", action="store_true", help="also time candidate tile configs of the Triton kernel")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: CUDA is not available here, so nothing is timed and no results are written")
        return 0 if cpu_smoke() else 1
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
