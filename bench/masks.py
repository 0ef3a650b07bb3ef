"""Time to build one training step's anchor-block masks on CPU, against a realistic GPU step.

Shapes (a realistic long-context training row): S = 8192 context tokens, 512 anchors, B = 16 (8192 block queries,
16384 keys). A step builds each layer kind's mask once (AnchorBlockLayout caches it for every layer of that kind);
we time both kinds a drafter can have: full attention and sliding (W = 2048) with in-block causality.

Measured on this CPU as the minimum over repeats (timeit's convention; the median, inflated on a shared 2-core box, is
recorded too): the flex BlockMask built from the contiguous context ranges (what training uses, on one thread); the
same through torch's create_block_mask (mask_mod on all 134 M pairs); the dense boolean mask (sdpa and the tests).
The fast and the reference BlockMasks are checked equal tensor for tensor.

Assumed GPU step: the drafter's forward + backward for a Qwen3-8B-sized drafter (5 layers, hidden 4096, 32 q / 8 kv
heads of 128, MLP 12288, vocab 151,936) on one row of 8192 context tokens and 512 x 16 = 8192 block queries on an H200:
  layers   5 x [q,o: 2*2*4096^2*8192 + k,v: 2*2*4096*1024*16384 + MLP: 2*3*4096*12288*8192]
           = 16.5 TFLOP fwd, x3 fwd+bwd = 49.5
  fc       2*(5*4096)*4096*8192 = 1.4 TFLOP fwd, x2 (features frozen, weight grad only) = 2.8
  lm_head  2*4096*151936*8192 = 10.2 TFLOP fwd, x2 (frozen weight, input grad only) = 20.4
  attention (useful work, ~2000 visible keys per query on average) 4*8192*2000*128*32 * 5 layers * 3.5 = 4.7
  total ~77 TFLOP; at 50% of the H200's 989 dense bf16 TFLOP/s ~155 ms. We assume 150 ms (rounding down makes
  the ratio stricter). The frozen target's forward (~131 TFLOP for Qwen3-8B at 8192 tokens) is not counted: on the
  same GPU it would more than double the step, on a separate GPU it overlaps; either way 150 ms is a lower bound.
Requirement: the BlockMask build of a step (both kinds) < 5% of that step.

Run: .venv/bin/python bench/masks.py   (writes bench/results/masks.json)
"""
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import write_json

from dflash_nb.anchors import sample_anchors
from dflash_nb.masks import anchor_block_block_mask, block_masks_equal, dense_anchor_block_mask

S, N, B = 8192, 512, 16
KINDS = {"full": (None, False), "sliding": (2048, True)}
GPU_STEP_MS = 150.0
LIMIT = 0.05


def timed(fn, repeat):
    "(min ms, median ms, result) over `repeat` runs after a warm-up."
    fn()                                              # warm-up (allocator, lazy imports)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times), statistics.median(times), out


def main(quick: bool = False):
    g = torch.Generator().manual_seed(0)
    # a realistic packed row: documents of 300..3000 tokens, ~70% of tokens trained on, a short padding tail
    doc = torch.full((S,), -1, dtype=torch.long)
    pos, d = 0, 0
    while pos < S - 64:
        n = min(int(torch.randint(300, 3000, (1,), generator=g)), S - 64 - pos)
        doc[pos:pos + n] = d
        pos, d = pos + n, d + 1
    loss_mask = (torch.rand(S, generator=g) > 0.3) & (doc >= 0)
    anchors, keep = sample_anchors(loss_mask, doc, B, N, generator=g)
    rep = 5 if quick else 30
    res = dict(S=S, num_anchors=N, block_size=B, documents=d, kept_anchors=int(keep.sum()), torch=torch.__version__,
               threads=torch.get_num_threads(), blockmask_threads=1,
               machine=platform.processor() or platform.machine(), kinds={})
    total_fast = total_med = 0.0
    for kind, (W, c) in KINDS.items():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)   # a few hundred KB of tensor work: one thread is as fast, immune to oversubscription
        t_fast, t_fast_med, fast = timed(lambda: anchor_block_block_mask(anchors, keep, doc, B, W, c), rep)
        torch.set_num_threads(threads)
        t_dense, _, dense = timed(lambda: dense_anchor_block_mask(anchors, keep, doc, B, W, c), max(1, rep // 3))
        t_ref, _, ref = timed(lambda: anchor_block_block_mask(anchors, keep, doc, B, W, c, method="mask_mod"), 1)
        equal = block_masks_equal(fast, ref)
        if not equal: raise SystemExit(f"{kind}: BlockMask from ranges differs from create_block_mask")
        total_fast += t_fast
        total_med += t_fast_med
        res["kinds"][kind] = dict(window=W, causal_in_block=c, blockmask_ranges_ms=round(t_fast, 3),
                                  blockmask_ranges_median_ms=round(t_fast_med, 3),
                                  blockmask_create_block_mask_ms=round(t_ref, 1), dense_mask_ms=round(t_dense, 1),
                                  dense_mask_mb=round(dense.numel() / 2**20, 1), sparsity_pct=round(fast.sparsity(), 2),
                                  equal_to_create_block_mask=equal)
        print(f"{kind:>8}: BlockMask from ranges {t_fast:7.3f} ms | create_block_mask {t_ref:8.1f} ms "
              f"({t_ref / t_fast:,.0f}x slower) | dense mask {t_dense:6.1f} ms ({dense.numel() / 2**20:.0f} MB) | "
              f"tiles skipped {fast.sparsity():.1f}% | equal: {equal}")
    ratio = total_fast / GPU_STEP_MS
    res.update(gpu_step_ms_assumed=GPU_STEP_MS, blockmask_step_ms=round(total_fast, 3), ratio=round(ratio, 5),
               blockmask_step_median_ms=round(total_med, 3), ratio_median=round(total_med / GPU_STEP_MS, 5),
               limit=LIMIT, ok=ratio < LIMIT,
               step_basis="Qwen3-8B-sized drafter fwd+bwd, 8192 ctx + 8192 block tokens, ~77 TFLOP at ~50% of H200 "
                          "bf16 peak")
    print(f"step BlockMask build (both kinds): {total_fast:.3f} ms = {100 * ratio:.2f}% of an assumed "
          f"{GPU_STEP_MS:.0f} ms GPU step (limit {100 * LIMIT:.0f}%): {'OK' if ratio < LIMIT else 'TOO SLOW'}  "
          f"[median {total_med:.3f} ms = {100 * total_med / GPU_STEP_MS:.2f}%]")
    out = write_json(Path(__file__).parent / "results" / "masks.json", res, indent=2)
    print(f"wrote {out}")
    return 0 if ratio < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))
