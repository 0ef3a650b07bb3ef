"""Fused anchor-block attention: launcher, tile configurations, autograd Function.

Installed as `dflash_nb.kernels.anchor_attention`. `kernels/` has no `__init__.py` on purpose: a regular package
named `kernels` at the project root would shadow Hugging Face's `kernels` distribution (which transformers imports)
for every `python` started there; a folder without one is at most a namespace portion, and an installed regular
package always wins over those. Importing this module builds no kernel: the Triton functions are created on first
use, in interpreter mode for CPU tensors (or when TRITON_INTERPRET=1) and compiled for CUDA tensors.

The kernels themselves (and the definition of every symbol: S, N, B, NB, L, CS/CE, own keys, GROUP, BPT,
ROWS, BLOCK_M, BLOCK_N, T, LSE) are in `_anchor_attn_src.py`. Public entry point:

    anchor_block_attention_triton(q, k, v, ctx_start, ctx_end, block_size, causal_in_block=False, scale=None,
                                  window=None)

q (1, H, N*B, D); k, v (1, H_kv, S + N*B, D) with H % H_kv == 0; ctx_start / ctx_end int (N,) from
`dflash_nb.masks.anchor_context_ranges` with the same window (the union over each block's slots); `window` is
the sliding window W, applied per query row inside the kernel (slot k of anchor a sees context [a + k + 1 - W, a)).
Returns (1, H, N*B, D) in q's dtype; differentiable in q, k, v.

Backward strategy. dQ: one program per (query head, query tile), the same walk as the forward (no atomics).
dK/dV: one program per (kv head, kv tile) that loops over the query tiles whose union range or own-key range
overlaps the kv tile (a list built on the host with a few small torch ops, no device sync), and over the GROUP
query heads sharing the kv head. Every dK/dV element is produced by one program in a fixed order, so the
gradients are bitwise deterministic (no fp32 atomics), and the GQA reduction over heads is free. The list does
not assume monotone ranges, so any per-block ranges are handled; with sorted anchors it is contiguous anyway.
"""
import importlib.util
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["anchor_block_attention_triton", "TileConfig", "CONFIGS", "SMEM_LIMIT", "pick_config",
           "override_configs", "LAUNCHED", "compile_for_target", "compiled_smem", "ptxas_stats",
           "tile_ranges", "kv_tile_plan", "interpret_requested", "LOG2_E"]

LOG2_E = 1.4426950408889634  # log2(e) = 1/ln 2: the kernels' softmax runs in base 2 (exp2), scores scaled by this
NO_WINDOW = 1 << 30  # WINDOW passed for full layers: larger than any distance, no overflow in int32 bounds
SMEM_LIMIT = 101_376  # bytes of shared memory per block on SM120 (RTX PRO 6000 / RTX 5090); H100/H200 allow 232,448


@dataclass(frozen=True)
class TileConfig:
    "One kernel's launch shape."
    block_m: int  # target query rows per tile; the tile holds max(1, block_m // B) whole draft blocks
    block_n: int  # kv columns per tile
    num_warps: int
    num_stages: int  # software-pipelining depth of the kv loop (fwd, dQ) or query-head loop (dK/dV)


# Config table, keyed by (head_dim, bytes per input element). How the constants were chosen (no GPU was available
# when this table was written; `dflash-gpu-check --sweep` times alternatives on a real one):
# * hard limit: every config fits SM120's 101,376 bytes of shared memory, checked on both sm_90 and sm_120 from the
#   metadata of an ahead-of-time compile with the specialisation a real launch gets (aligned pointers and strides,
#   which is what turns on cp.async pipelining and its buffers): tests/test_kernel_compile.py (Triton's wheel ships
#   ptxas, so this runs on the CPU); the bench reads the launched kernels' metadata again on the GPU.
# * no register spills (ptxas -v with Triton's flags, `ptxas_stats`) on either target; among configs that fit and
#   do not spill, the largest query tile, then the deepest pipeline.
# * block_m (query rows, = whole blocks of B = 16): 128 (8 blocks) for the forward at D <= 128 and dQ at D = 64,
#   64 at D = 256: each K/V tile loaded from L2 serves block_m rows, while a tile's union range grows by only
#   ~16 columns per extra block (512 anchors in 8K tokens). dQ at D >= 128 keeps Q, dO and the dQ accumulator
#   resident, so it uses 64 / 32 rows. dK/dV streams query tiles past resident K, V, dK, dV: 32 rows.
# * block_n: 32 where the score tile must stay small (a 64 x 64 or 128 x 64 fp32 score tile spills at D >= 128 on
#   sm_120), 64 / 128 at D = 64 where K/V tiles are small; 128 for dK/dV at D = 64 amortises the per-query-tile
#   loads (Q, dO, LSE, delta) over more keys.
# * num_stages 3 (two kv tiles in flight) wherever the extra buffer still fits: the forward at D <= 128 and dQ at
#   D <= 128; 2 otherwise.
# * num_warps 8 everywhere: with 4 warps the same tiles spill on sm_120 (every per-thread accumulator share doubles).
# Measured with Triton 3.7.1, bf16 (sm_90 / sm_120): shared bytes; registers; spill bytes
#   D=64   fwd 65536/49152 157/174 0/0    dq 57344/49152 104/168 0/0    dkdv 49408/41216 189/180 0/0
#   D=128  fwd 81920/65536 152/184 0/0    dq 81920/69632 112/164 0/0    dkdv 65792/53504 210/209 0/0
#   D=256  fwd 98304/69632 174/226 0/0    dq 67584/67584 128/142 12/0   dkdv 67840/67840 200/176 0/0
# fp32 inputs (tests, debugging) use small tiles since every element is twice as wide (checked for shared memory
# only: fp32 is not a training dtype here).
_C = TileConfig
CONFIGS = {
    (64, 2): {"fwd": _C(128, 64, 8, 3), "dq": _C(128, 32, 8, 3), "dkdv": _C(32, 128, 8, 2)},
    (128, 2): {"fwd": _C(128, 32, 8, 3), "dq": _C(64, 32, 8, 3), "dkdv": _C(32, 64, 8, 2)},
    (256, 2): {"fwd": _C(64, 32, 8, 2), "dq": _C(32, 32, 8, 2), "dkdv": _C(32, 32, 8, 2)},
    (64, 4): {"fwd": _C(32, 32, 4, 2), "dq": _C(32, 32, 4, 2), "dkdv": _C(32, 32, 4, 2)},
    (128, 4): {"fwd": _C(32, 32, 4, 2), "dq": _C(32, 32, 4, 1), "dkdv": _C(16, 32, 4, 1)},
    (256, 4): {"fwd": _C(16, 16, 4, 1), "dq": _C(16, 16, 4, 1), "dkdv": _C(16, 16, 4, 1)},
}
# Other power-of-two head dims (16, 32) borrow the D = 64 row.

_OVERRIDE: dict = {}
LAUNCHED: dict = {}  # (kernel, head_dim, dtype, BLOCK_M, BLOCK_N, warps, stages, capability) -> shared bytes


@contextmanager
def override_configs(**cfgs):
    "Temporarily force tile configs, e.g. `override_configs(fwd=TileConfig(16, 16, 1, 1))` (tests, tuning)."
    old = dict(_OVERRIDE)
    _OVERRIDE.update(cfgs)
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(old)


def _next_pow2(x):
    return 1 << (max(1, int(x)) - 1).bit_length()


def pick_config(kind, head_dim, dtype, block_size):
    "Return (TileConfig with block_m = BLOCK_M, BPT) for kernel `kind` in ('fwd', 'dq', 'dkdv')."
    cfg = _OVERRIDE.get(kind)
    if cfg is None:
        esize = 4 if dtype == torch.float32 else 2
        cfg = CONFIGS[(max(64, head_dim), esize)][kind]
    bpt = max(1, cfg.block_m // block_size)
    return replace(cfg, block_m=max(16, _next_pow2(bpt * block_size))), bpt


# ---------------------------------------------------------------------------------------------- loading
_VARIANTS: dict = {}
_SRC = Path(__file__).with_name("_anchor_attn_src.py")


def interpret_requested():
    "Whether the environment asks for Triton's interpreter (TRITON_INTERPRET=1, true, on or yes): the one reader."
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _use_interpreter(x):
    "Interpreter for CPU tensors, or everywhere when TRITON_INTERPRET is set in the environment."
    return x.device.type != "cuda" or interpret_requested()


@contextmanager
def _interpret_env(interpret):
    "Set TRITON_INTERPRET for the duration of a launch (Triton consults it lazily, e.g. when gluon is imported)."
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _kernels(interpret):
    """The kernel module built in interpreter mode or compiled mode. `@triton.jit` reads TRITON_INTERPRET when
    the decorator runs, so the source is executed once per mode with the variable set for that execution only:
    importing dflash_nb.kernels never builds kernels, and the order of imports in a test session is irrelevant."""
    mod = _VARIANTS.get(interpret)
    if mod is not None:
        return mod
    name = "dflash_nb.kernels._anchor_attn_" + ("interp" if interpret else "jit")
    spec = importlib.util.spec_from_file_location(name, _SRC)
    mod = importlib.util.module_from_spec(spec)
    with _interpret_env(interpret):
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    _VARIANTS[interpret] = mod
    return mod


# ---------------------------------------------------------------------------------------------- plans
def tile_ranges(cs, ce, S, N, B, bpt):
    "Per query tile: union context range [lo, hi) (lo >= hi when empty), int64 (T,)."
    T = -(-N // bpt)
    pad = T * bpt - N
    cs2 = torch.nn.functional.pad(cs.long(), (0, pad)).view(T, bpt)
    ce2 = torch.nn.functional.pad(ce.long(), (0, pad)).view(T, bpt)
    live = ce2 > cs2
    lo = torch.where(live, cs2, S).amin(1)
    hi = torch.where(live, ce2, 0).amax(1)
    return lo, hi


def _q_tile_order(cs, ce, S, N, B, bpt):
    "Query tiles sorted by context work, heaviest first (longest-processing-time-first scheduling)."
    lo, hi = tile_ranges(cs, ce, S, N, B, bpt)
    work = (hi - lo).clamp(min=0)
    return torch.argsort(work, descending=True, stable=True).to(torch.int32).contiguous()


def kv_tile_plan(cs, ce, S, N, B, bpt, block_n):
    "For each kv tile: the query tiles that can see it (ascending, padded), their count, and a launch order."
    NB, rows = N * B, bpt * B
    L = S + NB
    lo, hi = tile_ranges(cs, ce, S, N, B, bpt)
    T = lo.numel()
    dev = cs.device
    t = torch.arange(T, device=dev)
    own_lo, own_hi = S + t * rows, S + torch.clamp((t + 1) * rows, max=NB)
    n_lo = torch.arange(0, L, block_n, device=dev)
    n_hi = torch.clamp(n_lo + block_n, max=L)
    inter = (lo[None] < n_hi[:, None]) & (n_lo[:, None] < hi[None])
    inter |= (own_lo[None] < n_hi[:, None]) & (n_lo[:, None] < own_hi[None])
    count = inter.sum(1).to(torch.int32).contiguous()
    lst = torch.argsort((~inter).to(torch.int8), dim=1, stable=True).to(torch.int32).contiguous()
    order = torch.argsort(count, descending=True, stable=True).to(torch.int32).contiguous()
    return lst, count, order, T


# ---------------------------------------------------------------------------------------------- launch
def _record(kern, name, cfg, head_dim, dtype, device):
    md = getattr(kern, "metadata", None)
    shared = getattr(md, "shared", None)
    if shared is None:
        return
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    LAUNCHED[(name, head_dim, str(dtype).replace("torch.", ""), cfg.block_m, cfg.block_n, cfg.num_warps,
              cfg.num_stages, cap)] = int(shared)


def _launch_opts(cfg, interpret):
    return {} if interpret else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _check(q, k, v, cs, ce, B):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-d: q (1, H, N*B, D), k/v (1, H_kv, S + N*B, D)")
    if q.shape[0] != 1 or k.shape[0] != 1 or v.shape[0] != 1:
        raise ValueError(f"batch dim must be 1 (one packed row), got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    _, H, NB, D = q.shape
    HKV, L = k.shape[1], k.shape[2]
    if k.shape[3] != D:
        raise ValueError(f"head_dim differs: q {D}, k {k.shape[3]}")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {D}")
    if H % HKV:
        raise ValueError(f"q heads ({H}) must be a multiple of kv heads ({HKV})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")
    if B < 1 or NB % B:
        raise ValueError(f"N*B = {NB} queries is not a multiple of block_size {B}")
    N = NB // B
    if cs.shape != (N,) or ce.shape != (N,):
        raise ValueError(f"ctx_start / ctx_end must have shape ({N},), got {tuple(cs.shape)}, {tuple(ce.shape)}")
    S = L - NB
    if S < 0:
        raise ValueError(f"kv length {L} is shorter than the {NB} block keys")
    return H, HKV, N, NB, D, S, L


def _prep_ranges(cs, ce, S, device):
    cs = cs.to(device=device, dtype=torch.int32).contiguous()
    ce = ce.to(device=device, dtype=torch.int32).contiguous()
    if device.type == "cuda":  # no host sync on the hot path: clamp so a bad range can never read out of bounds
        cs = cs.clamp(0, S)
        ce = torch.maximum(ce.clamp(0, S), cs)
    elif bool(((cs < 0) | (ce < cs) | (ce > S)).any()):
        raise ValueError(f"context ranges must satisfy 0 <= ctx_start <= ctx_end <= S = {S}")
    return cs, ce


def _last_dim_contig(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(q, k, v, cs, ce, B, causal, scale, window):
    H, HKV, N, NB, D, S, L = _check(q, k, v, cs, ce, B)
    interpret = _use_interpreter(q)
    kern = _kernels(interpret)
    q, k, v = _last_dim_contig(q), _last_dim_contig(k), _last_dim_contig(v)
    o = torch.empty((1, H, NB, D), device=q.device, dtype=q.dtype)
    lse = torch.empty((H, NB), device=q.device, dtype=torch.float32)
    if NB == 0:
        return o, lse
    cfg, bpt = pick_config("fwd", D, q.dtype, B)
    order = _q_tile_order(cs, ce, S, N, B, bpt)
    grid = (H, order.numel())
    k_ = kern._fwd[grid](
        q, k, v, o, lse, cs, ce, order,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), o.stride(1), o.stride(2),
        S, NB, window, H // HKV, scale * LOG2_E,
        B=B, BPT=bpt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D, CAUSAL=bool(causal),
        UPCAST=interpret, IEEE=q.dtype == torch.float32, **_launch_opts(cfg, interpret))
    if not interpret:
        _record(k_, "fwd", cfg, D, q.dtype, q.device)
    return o, lse


def _backward(do, q, k, v, o, lse, cs, ce, B, causal, scale, window):
    H, HKV, N, NB, D, S, L = _check(q, k, v, cs, ce, B)
    interpret = _use_interpreter(q)
    kern = _kernels(interpret)
    q, k, v, do = _last_dim_contig(q), _last_dim_contig(k), _last_dim_contig(v), _last_dim_contig(do)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty((1, HKV, L, D), device=k.device, dtype=k.dtype)
    dv = torch.empty((1, HKV, L, D), device=v.device, dtype=v.dtype)
    if NB == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty((H, NB), device=q.device, dtype=torch.float32)
    pre_m = max(16, 4096 // D)  # 64 fp32 values of O and dO per thread at 4 warps, for every head_dim
    kern._bwd_preprocess[(H, _cdiv(NB, pre_m))](
        o, do, delta, o.stride(1), o.stride(2), do.stride(1), do.stride(2), NB, BLOCK_M=pre_m, HEAD_DIM=D)
    common = dict(CAUSAL=bool(causal), UPCAST=interpret, IEEE=q.dtype == torch.float32, HEAD_DIM=D, B=B)
    qk_scale = scale * LOG2_E

    cfg, bpt = pick_config("dq", D, q.dtype, B)
    order = _q_tile_order(cs, ce, S, N, B, bpt)
    k_ = kern._bwd_dq[(H, order.numel())](
        q, k, v, do, dq, lse, delta, cs, ce, order,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        do.stride(1), do.stride(2), dq.stride(1), dq.stride(2),
        S, NB, window, H // HKV, qk_scale, scale,
        BPT=bpt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common, **_launch_opts(cfg, interpret))
    if not interpret:
        _record(k_, "dq", cfg, D, q.dtype, q.device)

    cfg, bpt = pick_config("dkdv", D, q.dtype, B)
    lst, count, korder, T = kv_tile_plan(cs, ce, S, N, B, bpt, cfg.block_n)
    k_ = kern._bwd_dkdv[(HKV, korder.numel())](
        q, k, v, do, dk, dv, lse, delta, cs, ce, korder, count, lst,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        do.stride(1), do.stride(2), dk.stride(1), dk.stride(2), dv.stride(1), dv.stride(2),
        S, NB, L, T, window, H // HKV, qk_scale, scale,
        BPT=bpt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common, **_launch_opts(cfg, interpret))
    if not interpret:
        _record(k_, "dkdv", cfg, D, q.dtype, q.device)
    return dq, dk, dv


def _cdiv(a, b):
    return -(-a // b)


class _AnchorBlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cs, ce, block_size, causal, scale, window):
        with _interpret_env(_use_interpreter(q)):
            o, lse = _forward(q, k, v, cs, ce, block_size, causal, scale, window)
        ctx.save_for_backward(q, k, v, o, lse, cs, ce)
        ctx.block_size, ctx.causal, ctx.scale, ctx.window = block_size, causal, scale, window
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, cs, ce = ctx.saved_tensors
        with _interpret_env(_use_interpreter(q)):
            dq, dk, dv = _backward(do, q, k, v, o, lse, cs, ce, ctx.block_size, ctx.causal, ctx.scale, ctx.window)
        return dq, dk, dv, None, None, None, None, None, None


@torch.compiler.disable  # opaque to torch.compile: a clean graph break instead of tracing the launcher
def anchor_block_attention_triton(q, k, v, ctx_start, ctx_end, block_size, causal_in_block=False, scale=None,
                                  window=None):
    """Attention of N draft blocks over their contiguous context range plus their own block keys.

    q (1, H, N*B, D); k, v (1, H_kv, S + N*B, D); ctx_start / ctx_end int (N,) with 0 <= start <= end <= S, the
    union of the block's slots' context (ctx_end = the anchor). Slot k of block j sees kv
    [max(ctx_start[j], ctx_end[j] + k + 1 - window), ctx_end[j]) and its own block's slots k' (only k' <= k with
    causal_in_block; only |k - k'| < window with a window). Returns (1, H, N*B, D) in q's dtype; differentiable
    in q, k, v."""
    B = int(block_size)
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding window must be >= 1 (it counts the query itself), got {window}")
    window = NO_WINDOW if window is None else min(int(window), NO_WINDOW)
    _check(q, k, v, ctx_start, ctx_end, B)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    S = k.shape[2] - q.shape[2]
    cs, ce = _prep_ranges(ctx_start, ctx_end, S, q.device)
    return _AnchorBlockAttention.apply(q, k, v, cs, ce, B, bool(causal_in_block), scale, window)


# ---------------------------------------------------------------------------------------------- AOT compile
def _signature(fn, kinds):
    sig = {}
    for name in fn.arg_names:
        sig[name] = kinds.get(name, "i32")
    return sig


def compile_for_target(kind, head_dim, dtype=torch.bfloat16, capability=90, block_size=16, causal=False, cfg=None):
    """Compile one kernel for a CUDA target without a GPU (ptxas ships with Triton) and return the
    CompiledKernel; `.metadata.shared` is the shared memory it needs. Used by tests and the bench."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = _kernels(False)
    if kind == "pre":  # the backward's delta = rowsum(dO * O) kernel (fixed shape, 4 warps)
        cfg, bpt = TileConfig(max(16, 4096 // head_dim), 16, 4, 1), 1
    elif cfg is None:
        cfg, bpt = pick_config(kind, head_dim, dtype, block_size)
    else:
        bpt = max(1, cfg.block_m // block_size)
        cfg = replace(cfg, block_m=max(16, _next_pow2(bpt * block_size)))
    ty = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    fn = {"fwd": kern._fwd, "dq": kern._bwd_dq, "dkdv": kern._bwd_dkdv, "pre": kern._bwd_preprocess}[kind]
    ptrs = {n: "*" + ty for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
    ptrs.update({n: "*fp32" for n in ("LSE", "DELTA")})
    ptrs.update({n: "*i32" for n in ("CS", "CE", "QT_ORDER", "KT_ORDER", "KT_COUNT", "KT_LIST")})
    ptrs.update({n: "fp32" for n in ("qk_scale", "sm_scale")})
    const = dict(B=block_size, BPT=bpt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim,
                 CAUSAL=bool(causal), UPCAST=False, IEEE=dtype == torch.float32)
    if kind == "pre":
        const = dict(BLOCK_M=cfg.block_m, HEAD_DIM=head_dim)
    ptrs.update({n: "constexpr" for n in const})
    sig = _signature(fn, ptrs)
    # the specialisation a real launch gets: 16-byte aligned tensors and strides divisible by 16 (D >= 16) carry
    # tt.divisibility = 16, which enables vectorised loads and cp.async pipelining (and its shared-memory buffers);
    # without it the compile would be pessimistic and under-report shared memory
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
               if t.startswith("*") or n.startswith("stride_")}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def compiled_smem(kind, head_dim, dtype=torch.bfloat16, capability=90, block_size=16, causal=False, cfg=None):
    "Shared-memory bytes of one kernel config, from the metadata of an ahead-of-time compile (no GPU needed)."
    return int(compile_for_target(kind, head_dim, dtype, capability, block_size, causal, cfg).metadata.shared)


def ptxas_stats(compiled, capability):
    """Registers per thread and spill bytes of a compiled kernel, from `ptxas -v` on its PTX with the flags Triton
    itself uses (the GPU-side `n_spills` needs a device; this does not). Returns dict(registers, spill_bytes)."""
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    arch = sm_arch_from_capability(capability)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(compiled.asm["ptx"])
        r = subprocess.run([get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                            f"--gpu-name={arch}", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True, check=True)
    log = r.stderr + r.stdout
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return dict(registers=int(regs[-1]) if regs else None, spill_bytes=int(spills[-1]) if spills else None)
