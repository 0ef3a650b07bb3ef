"""The fused anchor-block attention kernel (dflash_nb.kernels) against the dense reference mask + plain torch.

CPU runs go through the Triton interpreter: the kernel module builds its interpreted variant on first use for CPU
tensors, whatever TRITON_INTERPRET was when anything was imported (see kernels/anchor_attention.py::_kernels), so
this file neither needs nor sets the variable (setting it process-wide would change how Triton behaves for every
later test in the session).

Tolerance: err(x) = max|x - ref64| / max|ref64| against a float64 reference; the kernel must satisfy
err_kernel <= 3 * err_torch + FLOOR[dtype] (16 eps for fp32, 2 eps for fp16/bf16), where err_torch is plain torch attention run at the same dtype.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

from dflash_nb.kernels.anchor_attention import (CONFIGS, LAUNCHED, SMEM_LIMIT, TileConfig, anchor_block_attention_triton,
                               override_configs, pick_config)
from dflash_nb.masks import anchor_context_ranges, dense_anchor_block_mask

SMALL = TileConfig(16, 16, 4, 1)  # interpreter tiles: many tiles from small shapes


def make_row(doc_lens, anchors, n_pad=0, pad_tokens=0, pad_at=None):
    "doc_ids for documents of the given lengths (+ padding tokens), anchors given as (doc, offset) pairs."
    starts = [sum(doc_lens[:i]) for i in range(len(doc_lens))]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)] + [torch.full((pad_tokens,), -1)])
    a = sorted(starts[d] + o for d, o in anchors)
    assert all(0 <= o < doc_lens[d] for d, o in anchors)
    pos = a + [0] * n_pad
    keep = [True] * len(a) + [False] * n_pad
    if pad_at is not None:  # padded anchors in the middle (robustness: the kernel must not assume they trail)
        pos = a[:pad_at] + [0] * n_pad + a[pad_at:]
        keep = [True] * pad_at + [False] * n_pad + [True] * (len(a) - pad_at)
    return torch.tensor(pos), torch.tensor(keep), doc_ids.long()


def attention_torch(q, k, v, mask, scale):
    "Plain torch attention at the inputs' dtype (GQA by repeating kv heads)."
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def run_both(q, k, v, g, fn):
    q, k, v = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), g)
    return [o.detach(), dq, dk, dv]


def rel_err(x, ref):
    "Max error relative to the reference's scale; absolute when the reference is exactly zero (e.g. dq of a row that sees one key)."
    scale = ref.abs().max()
    return ((x.double() - ref).abs().max() / (scale if scale > 0 else 1.0)).item()


# absolute floor of the bound, in units of the dtype's eps: fp32 differences are pure summation-order noise
# (exp2 with the folded scale, tile-wise online softmax) and sit at a few eps, below which torch's own error is no
# useful yardstick; for 16-bit inputs the kernel computes in fp32 and only rounds once, so 2 eps is plenty.
FLOOR = {torch.float32: 16 * 2.0 ** -23, torch.float16: 2 * 2.0 ** -10, torch.bfloat16: 2 * 2.0 ** -7}


def check_case(doc_lens, anchors, B, H, HKV, D, dtype, window=None, causal=False, n_pad=0, pad_tokens=0,
               pad_at=None, cfg=SMALL, seed=0):
    anc, keep, doc_ids = make_row(doc_lens, anchors, n_pad, pad_tokens, pad_at)
    S, N = doc_ids.numel(), anc.numel()
    cs, ce = anchor_context_ranges(anc, keep, doc_ids, window)
    mask = dense_anchor_block_mask(anc, keep, doc_ids, B, window=window, causal_in_block=causal)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, N * B, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, HKV, S + N * B, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, HKV, S + N * B, D, generator=gen, dtype=torch.float64)
    g = torch.randn(1, H, N * B, D, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(D)
    ref = run_both(q, k, v, g, lambda q, k, v: attention_torch(q, k, v, mask, scale))
    lo = [x.to(dtype) for x in (q, k, v, g)]
    tor = run_both(*lo, lambda q, k, v: attention_torch(q, k, v, mask, scale))
    with override_configs(**({} if cfg is None else dict(fwd=cfg, dq=cfg, dkdv=cfg))):
        tri = run_both(*lo, lambda q, k, v: anchor_block_attention_triton(q, k, v, cs, ce, B, causal, window=window))
    for name, t, p, r in zip(("out", "dq", "dk", "dv"), tri, tor, ref):
        assert t.dtype == dtype and t.shape == r.shape, name
        assert torch.isfinite(t).all(), f"{name} has NaN/inf"
        e_tri, e_torch = rel_err(t, r), rel_err(p, r)
        bound = 3 * e_torch + FLOOR[dtype]
        assert e_tri <= bound, f"{name}: kernel error {e_tri:.3g} > bound {bound:.3g} (torch {e_torch:.3g})"
    # kv positions no query may see get exactly zero gradient (tiles without any query tile are still written)
    unseen = ~mask.any(0)
    assert (tri[2][0][:, unseen] == 0).all() and (tri[3][0][:, unseen] == 0).all()
    return tri


# (id, kwargs): every case uses the real mask module (dense reference + context ranges)
CASES = [
    # S = 37 (not a multiple of 16), 7 anchors (odd), anchors at document starts, a document shorter than B
    ("gqa4-d64-full-fp32", dict(doc_lens=[15, 3, 19], anchors=[(0, 0), (0, 5), (0, 14), (1, 0), (1, 2), (2, 0),
                                                                 (2, 11)], B=4, H=4, HKV=1, D=64,
                                dtype=torch.float32)),
    ("gqa6-d128-sliding-causal-fp16", dict(doc_lens=[30, 11], anchors=[(0, 3), (0, 9), (0, 20), (0, 29), (1, 1)],
                                           B=4, H=6, HKV=1, D=128, dtype=torch.float16, window=6, causal=True)),
    ("gqa1-d256-sliding-fp32", dict(doc_lens=[21, 2], anchors=[(0, 0), (0, 7), (0, 19), (1, 1)], B=4, H=2, HKV=2,
                                    D=256, dtype=torch.float32, window=9)),
    ("gqa1-d256-full-fp16", dict(doc_lens=[21], anchors=[(0, 4), (0, 13), (0, 20)], B=4, H=1, HKV=1, D=256,
                                 dtype=torch.float16)),
    # padded anchors in the middle and at the end, padding tokens, window 1 (no context at all; each slot sees itself)
    ("padded-window1-fp32", dict(doc_lens=[9, 2], anchors=[(0, 0), (0, 4), (1, 1)], B=4, H=4, HKV=2, D=64,
                                 dtype=torch.float32, window=1, n_pad=2, pad_tokens=5, pad_at=1)),
    # W < B, not causal: the window cuts the own block on both sides; anchors far past W - B + 1
    ("window-lt-b-bidirectional-fp32", dict(doc_lens=[40], anchors=[(0, 1), (0, 12), (0, 33), (0, 39)], B=8, H=2,
                                            HKV=1, D=32, dtype=torch.float32, window=3)),
    # W just above B, causal (the sliding layers of the served drafters): every slot's row bound differs
    ("window-b-plus-1-causal-fp16", dict(doc_lens=[26, 30], anchors=[(0, 2), (0, 9), (0, 25), (1, 6), (1, 29)], B=4,
                                         H=4, HKV=2, D=64, dtype=torch.float16, window=5, causal=True)),
    ("padded-trailing-gqa4-fp16", dict(doc_lens=[12, 14], anchors=[(0, 2), (0, 11), (1, 0), (1, 6), (1, 13)], B=4,
                                       H=8, HKV=2, D=64, dtype=torch.float16, n_pad=3, causal=True)),
    # block size that is not a power of two: tiles hold BPT whole blocks plus masked padding rows
    ("b3-gqa6-d128-causal-fp32", dict(doc_lens=[17, 8], anchors=[(0, 1), (0, 6), (0, 16), (1, 0), (1, 5)], B=3,
                                      H=6, HKV=1, D=128, dtype=torch.float32, causal=True)),
    ("bf16-d64", dict(doc_lens=[25], anchors=[(0, 3), (0, 8), (0, 24)], B=4, H=2, HKV=1, D=64,
                      dtype=torch.bfloat16, window=10)),
]


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference(kw):
    check_case(**kw)


GRID_LAYOUT = dict(doc_lens=[13, 2, 22], anchors=[(0, 0), (0, 6), (0, 12), (1, 1), (2, 0), (2, 9), (2, 21)], B=4,
                   n_pad=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("group", [1, 4, 6], ids=["gqa1", "gqa4", "gqa6"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_grid(D, group, kind, dtype):
    "head_dim x GQA ratio x layer kind x dtype on one awkward row (S = 37, 7 + 1 padded anchors, a 2-token doc)."
    sliding = kind == "sliding"
    check_case(**GRID_LAYOUT, H=group * (2 if group == 1 else 1), HKV=2 if group == 1 else 1, D=D, dtype=dtype,
               window=5 if sliding else None, causal=sliding, seed=D + group)


@pytest.mark.parametrize("seed", range(6))
def test_random_rows(seed):
    """Random packings: document lengths 1..20, random anchors (sorted, some at document starts), padded slots,
    block sizes 2..8, random window; S and N*B rarely multiples of the 16-row tiles."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    lens = [r(1, 20) for _ in range(r(1, 4))]
    anchors = sorted({(d, r(0, n - 1)) for d, n in enumerate(lens) for _ in range(r(0, 3))} | {(0, 0)})
    B = [2, 3, 4, 5, 8][r(0, 4)]
    window = [None, 1, 3, 7][r(0, 3)]
    group = [1, 2, 4][r(0, 2)]
    check_case(lens, anchors, B=B, H=group * 2, HKV=2, D=[32, 64][r(0, 1)], dtype=torch.float32, window=window,
               causal=bool(r(0, 1)), n_pad=r(0, 2), pad_tokens=r(0, 3), seed=seed)


def test_single_block():
    "One anchor, one block: the smallest problem (N = 1, a single partial tile everywhere)."
    check_case([6], [(0, 5)], B=2, H=1, HKV=1, D=16, dtype=torch.float32)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_production_tiles_b16(D):
    "The real (GPU) tile table at B = 16 (forward tiles of 8 / 8 / 4 whole blocks), S = 150, 9 anchors, two docs."
    anchors = [(0, 0), (0, 17), (0, 40), (0, 77), (0, 99), (1, 0), (1, 9), (1, 30), (1, 49)]
    check_case([100, 50], anchors, B=16, H=4, HKV=2, D=D, dtype=torch.float16, window=48, cfg=None)
    cfg, bpt = pick_config("fwd", D, torch.float16, 16)
    assert cfg.block_m == bpt * 16 == {64: 128, 128: 128, 256: 64}[D]


def test_deterministic_backward():
    "dK/dV are written by one program per kv tile in a fixed order (no atomics): bitwise identical gradients."
    kw = dict(doc_lens=[20, 9], anchors=[(0, 0), (0, 7), (0, 19), (1, 3), (1, 8)], B=4, H=4, HKV=1, D=64,
              dtype=torch.float16, window=8, causal=True)
    first, second = check_case(**kw), check_case(**kw)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_strided_inputs():
    "q/k/v as the model produces them, (1, L, H, D) transposed to (1, H, L, D), and a gradient with a zero stride."
    torch.manual_seed(0)
    cs, ce = torch.tensor([0, 2, 9], dtype=torch.int32), torch.tensor([5, 10, 11], dtype=torch.int32)
    q = torch.randn(1, 12, 4, 32).transpose(1, 2)
    k = torch.randn(1, 23, 2, 32).transpose(1, 2)
    v = torch.randn(1, 23, 2, 32).transpose(1, 2)
    outs = []
    for x in ((q, k, v), [t.contiguous() for t in (q, k, v)]):
        x = [t.detach().requires_grad_() for t in x]
        with override_configs(fwd=SMALL, dq=SMALL, dkdv=SMALL):
            o = anchor_block_attention_triton(*x, cs, ce, 4)
            o.sum(dim=2).square().sum().backward()  # d/do is expanded along the query rows (stride 0)
        outs.append([o.detach()] + [t.grad for t in x])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_config_table_relations():
    "Every table entry yields tiles of whole blocks for the block sizes DFlash uses."
    for (d, esize), kinds in CONFIGS.items():
        for kind in kinds:
            for B in (3, 8, 10, 16):
                cfg, bpt = pick_config(kind, d, torch.float32 if esize == 4 else torch.bfloat16, B)
                assert bpt * B <= cfg.block_m and cfg.block_m & (cfg.block_m - 1) == 0 and cfg.block_m >= 16


def test_rejects_bad_input():
    q = torch.randn(1, 4, 8, 64)
    kv = torch.randn(1, 3, 20, 64)
    cs = ce = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        anchor_block_attention_triton(q, kv, kv, cs, ce, 4)
    kv = torch.randn(1, 2, 20, 64)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        anchor_block_attention_triton(q[..., :48], kv[..., :48], kv[..., :48], cs, ce, 4)
    with pytest.raises(ValueError, match="context ranges"):
        anchor_block_attention_triton(q, kv, kv, cs, torch.tensor([3, 13], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="shape"):
        anchor_block_attention_triton(q, kv, kv, cs[:1], ce[:1], 4)


def test_interpreter_and_compiler_in_one_process():
    """Fresh processes: TRITON_INTERPRET set before import, unset, or only while `triton` itself was first imported
    (which decides how Triton's own standard library is built). In each, a CPU call (interpreter) and an ahead-of-
    time compile for sm_120 (compiler) both work, in that order."""
    code = ("import os, sys, torch\n"
            "if sys.argv[1] == 'triton-imported-interpreted':\n"
            "    os.environ['TRITON_INTERPRET'] = '1'; import triton; del os.environ['TRITON_INTERPRET']\n"
            "from dflash_nb.kernels.anchor_attention import anchor_block_attention_triton as f, compiled_smem\n"
            "q=torch.randn(1,2,8,16,requires_grad=True); k=torch.randn(1,1,18,16); v=torch.randn(1,1,18,16)\n"
            "cs=torch.tensor([0,2],dtype=torch.int32); ce=torch.tensor([5,10],dtype=torch.int32)\n"
            "o=f(q,k,v,cs,ce,4); o.sum().backward(); assert torch.isfinite(q.grad).all()\n"
            "assert compiled_smem('fwd', 64, capability=120) > 0\n"
            "print('ok')\n")
    for setup in ("env-set", "env-unset", "triton-imported-interpreted"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if setup == "env-set":
            env["TRITON_INTERPRET"] = "1"
        r = subprocess.run([sys.executable, "-c", code, setup], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "ok" in r.stdout, (setup, r.stderr[-2000:])


# ------------------------------------------------------------------------------------------------ GPU (bf16)
def _real_row(S, n_anchors, B, n_docs, seed):
    "A packed row of n_docs documents with sorted random anchors (some at document starts) and two padded slots."
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(S - 1, generator=g)[: n_docs - 1] + 1).values.tolist()
    bounds = [0] + cuts + [S]
    doc_ids = torch.cat([torch.full((bounds[i + 1] - bounds[i],), i) for i in range(n_docs)])
    a = torch.sort(torch.randperm(S, generator=g)[: n_anchors - 2 - n_docs]).values
    a = torch.unique(torch.cat([a, torch.tensor(bounds[:-1])])).sort().values
    n = a.numel()
    anchors = torch.cat([a, torch.zeros(n_anchors - n, dtype=torch.long)])
    keep = torch.arange(n_anchors) < n
    return anchors, keep, doc_ids


def _gpu_parity(H, HKV, D, S, n_anchors, B, window, causal, dtype=torch.bfloat16, backend=None):
    dev = torch.device("cuda")
    anchors, keep, doc_ids = [x.to(dev) for x in _real_row(S, n_anchors, B, 3, seed=D + H)]
    N = n_anchors
    cs, ce = anchor_context_ranges(anchors, keep, doc_ids, window)
    mask = dense_anchor_block_mask(anchors, keep, doc_ids, B, window=window, causal_in_block=causal)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, H, N * B, D, generator=gen, device=dev)
    k = torch.randn(1, HKV, S + N * B, D, generator=gen, device=dev)
    v = torch.randn(1, HKV, S + N * B, D, generator=gen, device=dev)
    g = torch.randn(1, H, N * B, D, generator=gen, device=dev)
    scale = 1 / math.sqrt(D)
    ref = run_both(q.double(), k.double(), v.double(), g.double(),
                   lambda q, k, v: attention_torch(q, k, v, mask, scale))
    lo = [x.to(dtype) for x in (q, k, v, g)]
    tor = run_both(*lo, lambda q, k, v: attention_torch(q, k, v, mask, scale))
    if backend is None:
        fn = lambda q, k, v: anchor_block_attention_triton(q, k, v, cs, ce, B, causal, window=window)
    else:
        from dflash_nb.attention import anchor_block_attention
        fn = lambda q, k, v: anchor_block_attention(q, k, v, anchors, keep, doc_ids, B, window=window,
                                                    causal_in_block=causal, backend=backend)
    out = run_both(*lo, fn)
    for name, t, p, r in zip(("out", "dq", "dk", "dv"), out, tor, ref):
        assert torch.isfinite(t).all(), f"{name} has NaN/inf"
        e, e_t = rel_err(t, r), rel_err(p, r)
        assert e <= 3 * e_t + FLOOR[dtype], f"{backend or 'triton'} {name}: {e:.3g} vs torch {e_t:.3g}"
    return out


GPU_SHAPES = [  # (H, HKV, D, S, anchors, B, window, causal): drafter head layouts, reduced S for the fp64 reference
    (32, 8, 128, 2048, 128, 16, None, False),  # Qwen3-8B drafter, full
    (32, 8, 128, 2048, 128, 16, 512, True),    # Qwen3-8B drafter, sliding + in-block causal
    (24, 4, 256, 2048, 128, 16, None, False),  # Qwen3.6-27B drafter (GQA 6, head_dim 256)
    (24, 4, 256, 1024, 64, 16, 256, True),
    (8, 8, 64, 1500, 97, 16, 300, False),      # head_dim 64, GQA 1, S not a multiple of the tile, odd anchors
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"h{s[0]}kv{s[1]}d{s[2]}w{s[6]}c{int(s[7])}" for s in GPU_SHAPES])
def test_gpu_bf16_parity(shape):
    _gpu_parity(*shape)
    for key, shared in LAUNCHED.items():
        assert shared <= SMEM_LIMIT, (key, shared)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gpu_other_dtypes(dtype):
    _gpu_parity(8, 2, 128, 1024, 64, 16, 256, True, dtype=dtype)


@pytest.mark.gpu
def test_gpu_deterministic():
    a = _gpu_parity(32, 8, 128, 2048, 128, 16, None, False)
    b = _gpu_parity(32, 8, 128, 2048, 128, 16, None, False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:3], ids=["8b-full", "8b-sliding", "27b-full"])
def test_gpu_flex_parity(shape):
    "flex_attention through the attention module, same reference (skipped until dflash_nb.attention exists)."
    pytest.importorskip("dflash_nb.attention")
    _gpu_parity(*shape, backend="flex")
