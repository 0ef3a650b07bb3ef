"""Triton kernels for anchor-block attention (forward, dQ, dK/dV). Launched from `anchor_attention.py`.

This file is executed by `anchor_attention._kernels()`, not imported directly: it is loaded once with
`TRITON_INTERPRET=1` (CPU tensors / interpreter) and once without (CUDA), because `@triton.jit` decides at
decoration time whether it builds a compiled or an interpreted function.

Symbols (the same names are used in the launcher):

  S         context length: kv indices 0 .. S-1 are the packed target-feature tokens of one row
  N         number of draft blocks = number of anchors (kept and padded); anchors are sorted among kept
  B         draft block size; query row r belongs to block j = r // B, slot k = r % B
  NB        N * B, the number of queries
  L         S + NB, the kv length: [ctx_0 .. ctx_{S-1} | block_0 .. block_{N-1}]
  CS, CE    int32 (N,): the union of the context ranges of block j's slots is kv [CS[j], CE[j])
            (0 <= CS <= CE <= S), = [max(doc_start(a_j), a_j + 1 - W), a_j); a padded block has CS == CE (empty)
  W         WINDOW, the sliding window (runtime int; a huge value for full layers). The query of slot k sits at
            position a_j + k and sees what the serving stack shows it: a key at position p' iff (a_j + k) - p' < W
            (and p' - (a_j + k) < W when not CAUSAL)
  row range the context of query row r (block j, slot k) is [max(CS[j], CE[j] + k + 1 - W), CE[j]): the block's
            union cut by the row's own window bound (CE[j] = a_j for a kept block)
  own keys  block j's own B keys are kv S + j*B + (0 .. B-1), slot k' at position a_j + k'; with CAUSAL (in-block
            causality, sliding layers) slot k sees only own slots k' <= k, and only k - k' < W (|k - k'| < W
            when not CAUSAL)
  H, HKV    query / key-value heads; GROUP = H // HKV; query head h reads kv head h // GROUP (GQA)
  D         head dim (HEAD_DIM, a power of two, 16 .. 256)
  BPT       whole draft blocks per query tile; ROWS = BPT * B query rows per tile
  BLOCK_M   power-of-two row count of the query tile (>= ROWS; rows ROWS .. BLOCK_M-1 are padding and are
            masked; BLOCK_M == ROWS whenever B is a power of two)
  BLOCK_N   kv columns per tile
  T         number of query tiles = cdiv(NB, ROWS); a query tile covers whole blocks, so its own keys are the
            contiguous kv range S + [t*ROWS, t*ROWS + ROWS)
  tile union range  [min CS, max CE) over the tile's non-empty blocks; the forward and dQ kernels walk it
            (then the tile's own keys) and mask per row, so no dense mask or BlockMask exists anywhere
  LSE       per (head, query row) log2-sum-exp of the scaled scores (base 2, scores pre-multiplied by
            scale * log2(e)); +inf for a row that sees nothing (cannot happen, guarded anyway: output 0)

Numerics: scores, softmax statistics and all accumulators are fp32; probabilities are cast to the input dtype
for the P @ V and dS @ K / dS^T @ Q products on the GPU (as in FlashAttention). UPCAST (interpreter only)
loads everything as fp32 because the interpreter computes bf16 wrongly. IEEE selects exact fp32 dots for fp32
inputs on the GPU (the default there would be TF32).
"""
import triton
import triton.language as tl

from dflash_nb.kernels.anchor_attention import interpret_requested

# Reductions go through tl.reduce with combine functions chosen here instead of tl.max / tl.min / tl.sum (and
# tl.full instead of tl.zeros): those are @triton.jit functions of Triton's own standard library, built in whichever
# mode TRITON_INTERPRET had when `triton` was first imported. Using only builtins plus functions of this file keeps
# each variant of this file self-consistent, so the interpreter and the compiler can both be used in one process.
if interpret_requested():
    from triton.language import standard as _std

    # the interpreter recognises these by identity and reduces with numpy (never calling them)
    _max_fn, _min_fn, _add_fn = _std._elementwise_max, _std._elementwise_min, _std._sum_combine
else:
    @triton.jit
    def _max_fn(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _min_fn(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _add_fn(a, b):
        return a + b


@triton.jit
def _check_tiles(B: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """Compile-time checks of a launch shape, shared by the three kernels: tl.dot's 16-multiples, whole blocks."""
    tl.static_assert(BPT * B <= BLOCK_M, "a query tile must hold whole draft blocks")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_M % 16 == 0, "tl.dot needs a multiple of 16 rows")
    tl.static_assert(BLOCK_N >= 16 and BLOCK_N % 16 == 0, "tl.dot needs a multiple of 16 columns")
    tl.static_assert((B & (B - 1)) != 0 or BPT * B == BLOCK_M, "power-of-two B: the tile is exactly BPT blocks")
    tl.static_assert(HEAD_DIM >= 16, "tl.dot needs a reduction dim of at least 16")


@triton.jit
def _own_visible(m2, rel, WINDOW, B: tl.constexpr, CAUSAL: tl.constexpr):
    """Own-block visibility of block key rel = n - S for query row m2: same block, then the serving rule on slots."""
    k = m2 % B
    k2 = rel % B
    vis = (rel // B == m2 // B) & (k - k2 < WINDOW) & (k2 - k < WINDOW)
    if CAUSAL:
        vis = vis & (k2 <= k)
    return vis


@triton.jit
def _visible(m2, n2, lo2, hi2, S, WINDOW, B: tl.constexpr, CTX: tl.constexpr, OWN: tl.constexpr,
             CAUSAL: tl.constexpr):
    """Boolean visibility of kv index n2 for query row m2 (both broadcast to the tile shape); lo2/hi2 = row range."""
    if CTX:
        vis = (n2 >= lo2) & (n2 < hi2)  # the row's context range (its window bound already in lo2)
        if OWN:
            rel = n2 - S  # negative for context columns; masked by n2 >= S below
            vis = vis | ((n2 >= S) & _own_visible(m2, rel, WINDOW, B, CAUSAL=CAUSAL))
    else:
        vis = _own_visible(m2, n2 - S, WINDOW, B, CAUSAL=CAUSAL)  # own-key phase: every column is >= S
    return vis


@triton.jit
def _row_range(CS, CE, offs_m, row_ok, WINDOW, B: tl.constexpr):
    """Context range of each query row: its block's union [CS, CE) cut by the row's window bound CE + k + 1 - W."""
    blk = offs_m // B
    row_lo = tl.load(CS + blk, mask=row_ok, other=0)
    row_hi = tl.load(CE + blk, mask=row_ok, other=0)
    row_lo = tl.maximum(row_lo, row_hi + (offs_m % B) + 1 - WINDOW)
    return row_lo, row_hi


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, exact fp32 when IEEE."""
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _query_tile(CS, CE, QT_ORDER, S, NB, WINDOW, B: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's query tile: first row, rows, their validity, row context ranges, the tile union [lo, hi)."""
    tile = tl.load(QT_ORDER + tl.program_id(1))  # heaviest tiles first (host-side order)
    offs_r = tl.arange(0, BLOCK_M)
    row0 = tile * ROWS
    offs_m = row0 + offs_r
    row_ok = (offs_r < ROWS) & (offs_m < NB)
    row_lo, row_hi = _row_range(CS, CE, offs_m, row_ok, WINDOW, B)
    live = row_hi > row_lo
    lo = tl.reduce(tl.where(live, row_lo, S), 0, _min_fn)  # union of the tile's context ranges (empty: lo=S > hi=0)
    hi = tl.reduce(tl.where(live, row_hi, 0), 0, _max_fn)
    return row0, offs_m, row_ok, row_lo, row_hi, lo, hi


@triton.jit
def _scores_tile(q, k_base, v_base, stride_kn, stride_vn, start_n, hi, offs_m, row_ok, row_lo, row_hi, S, WINDOW,
                 B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 CTX: tl.constexpr, OWN: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                 IEEE: tl.constexpr):
    """Load the kv tile at start_n (columns >= hi masked) and score it: (k, v, q @ k^T, visibility); fwd and dQ."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hi
    kv_rows = offs_n.to(tl.int64)[:, None]
    k = tl.load(k_base + kv_rows * stride_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(v_base + kv_rows * stride_vn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = _dot(q, tl.trans(k), tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32), IEEE)
    vis = _visible(offs_m[:, None], offs_n[None, :], row_lo[:, None], row_hi[:, None], S, WINDOW, B, CTX=CTX, OWN=OWN,
                   CAUSAL=CAUSAL)
    return k, v, qk, vis & col_ok[None, :] & row_ok[:, None]


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, hi,
               offs_m, row_ok, row_lo, row_hi, S, WINDOW, qk_scale,
               B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               CTX: tl.constexpr, OWN: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
               IEEE: tl.constexpr):
    """Online-softmax sweep of kv columns [lo, hi) for one query tile (context phase or own-key phase)."""
    for start_n in range(lo, hi, BLOCK_N):
        k, v, qk, vis = _scores_tile(q, k_base, v_base, stride_kn, stride_vn, start_n, hi, offs_m, row_ok, row_lo,
                                     row_hi, S, WINDOW, B, BLOCK_M, BLOCK_N, HEAD_DIM, CTX=CTX, OWN=OWN,
                                     CAUSAL=CAUSAL, UPCAST=UPCAST, IEEE=IEEE)
        s = tl.where(vis, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_fn))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: no inf - inf
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.reduce(p, 1, _add_fn)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["S", "NB", "WINDOW"])
def _fwd(Q, K, V, O, LSE, CS, CE, QT_ORDER,
         stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_om,
         S, NB, WINDOW, GROUP, qk_scale,
         B: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Forward: one program per (query head, query tile of BPT whole draft blocks)."""
    _check_tiles(B, BPT, BLOCK_M, BLOCK_N, HEAD_DIM)
    ROWS: tl.constexpr = BPT * B
    h = tl.program_id(0)
    hk = h // GROUP
    row0, offs_m, row_ok, row_lo, row_hi, lo, hi = _query_tile(CS, CE, QT_ORDER, S, NB, WINDOW, B, ROWS, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = Q + h.to(tl.int64) * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + hk.to(tl.int64) * stride_kh
    v_base = V + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, hi,
                               offs_m, row_ok, row_lo, row_hi, S, WINDOW, qk_scale,
                               B, BLOCK_M, BLOCK_N, HEAD_DIM, CTX=True, OWN=False, CAUSAL=CAUSAL, UPCAST=UPCAST,
                               IEEE=IEEE)
    own_hi = S + tl.minimum(row0 + ROWS, NB)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, S + row0, own_hi,
                               offs_m, row_ok, row_lo, row_hi, S, WINDOW, qk_scale,
                               B, BLOCK_M, BLOCK_N, HEAD_DIM, CTX=False, OWN=True, CAUSAL=CAUSAL, UPCAST=UPCAST,
                               IEEE=IEEE)
    seen = l_i > 0.0
    l_div = tl.where(seen, l_i, 1.0)
    out = acc / l_div[:, None]  # rows that see nothing: acc == 0 -> 0, never NaN
    lse = tl.where(seen, m_i + tl.log2(l_div), float("inf"))
    o_ptrs = O + h.to(tl.int64) * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h.to(tl.int64) * NB + offs_m, lse, mask=row_ok)


@triton.jit(do_not_specialize=["NB"])
def _bwd_preprocess(O, DO, DELTA, stride_oh, stride_om, stride_doh, stride_dom, NB,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta[h, r] = sum_d dO[h, r, d] * O[h, r, d] (fp32)."""
    h = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m < NB
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(O + h.to(tl.int64) * stride_oh + rows * stride_om + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + h.to(tl.int64) * stride_doh + rows * stride_dom + offs_d[None, :], mask=ok[:, None], other=0.0)
    delta = tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, _add_fn)
    tl.store(DELTA + h.to(tl.int64) * NB + offs_m, delta, mask=ok)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, lo, hi,
              offs_m, row_ok, row_lo, row_hi, S, WINDOW, qk_scale,
              B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              CTX: tl.constexpr, OWN: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
              IEEE: tl.constexpr):
    """dQ accumulation over kv columns [lo, hi) (recomputes P from the saved LSE)."""
    zero = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k, v, qk, vis = _scores_tile(q, k_base, v_base, stride_kn, stride_vn, start_n, hi, offs_m, row_ok, row_lo,
                                     row_hi, S, WINDOW, B, BLOCK_M, BLOCK_N, HEAD_DIM, CTX=CTX, OWN=OWN,
                                     CAUSAL=CAUSAL, UPCAST=UPCAST, IEEE=IEEE)
        p = tl.where(vis, tl.exp2(qk * qk_scale - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), zero, IEEE)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, IEEE)
    return dq


@triton.jit(do_not_specialize=["S", "NB", "WINDOW"])
def _bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, CS, CE, QT_ORDER,
            stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn,
            stride_doh, stride_dom, stride_dqh, stride_dqm,
            S, NB, WINDOW, GROUP, qk_scale, sm_scale,
            B: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """dQ: one program per (query head, query tile); walks the same kv ranges as the forward."""
    _check_tiles(B, BPT, BLOCK_M, BLOCK_N, HEAD_DIM)
    ROWS: tl.constexpr = BPT * B
    h = tl.program_id(0)
    hk = h // GROUP
    row0, offs_m, row_ok, row_lo, row_hi, lo, hi = _query_tile(CS, CE, QT_ORDER, S, NB, WINDOW, B, ROWS, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    rows = offs_m.to(tl.int64)[:, None]
    q = tl.load(Q + h.to(tl.int64) * stride_qh + rows * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + h.to(tl.int64) * stride_doh + rows * stride_dom + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + h.to(tl.int64) * NB + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + h.to(tl.int64) * NB + offs_m, mask=row_ok, other=0.0)
    k_base = K + hk.to(tl.int64) * stride_kh
    v_base = V + hk.to(tl.int64) * stride_vh

    dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, lo, hi,
                   offs_m, row_ok, row_lo, row_hi, S, WINDOW, qk_scale,
                   B, BLOCK_M, BLOCK_N, HEAD_DIM, CTX=True, OWN=False, CAUSAL=CAUSAL, UPCAST=UPCAST, IEEE=IEEE)
    own_hi = S + tl.minimum(row0 + ROWS, NB)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, S + row0, own_hi,
                   offs_m, row_ok, row_lo, row_hi, S, WINDOW, qk_scale,
                   B, BLOCK_M, BLOCK_N, HEAD_DIM, CTX=False, OWN=True, CAUSAL=CAUSAL, UPCAST=UPCAST, IEEE=IEEE)
    dq = dq * sm_scale
    tl.store(DQ + h.to(tl.int64) * stride_dqh + rows * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["S", "NB", "L", "NUM_QT", "WINDOW"])
def _bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, CS, CE, KT_ORDER, KT_COUNT, KT_LIST,
              stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn,
              stride_doh, stride_dom, stride_dkh, stride_dkn, stride_dvh, stride_dvn,
              S, NB, L, NUM_QT, WINDOW, GROUP, qk_scale, sm_scale,
              B: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """dK/dV: one program per (kv head, kv tile); loops over the query tiles that see the kv tile
    (host-built list KT_LIST[kt, :KT_COUNT[kt]], ascending) and over the GROUP query heads of the kv head.
    Each dK/dV element is written by exactly one program: no atomics, bitwise deterministic."""
    _check_tiles(B, BPT, BLOCK_M, BLOCK_N, HEAD_DIM)
    ROWS: tl.constexpr = BPT * B
    hk = tl.program_id(0)
    kt = tl.load(KT_ORDER + tl.program_id(1))  # busiest kv tiles first
    offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < L
    offs_d = tl.arange(0, HEAD_DIM)
    cols = offs_n.to(tl.int64)[:, None]
    k = tl.load(K + hk.to(tl.int64) * stride_kh + cols * stride_kn + offs_d[None, :], mask=col_ok[:, None],
                other=0.0)
    v = tl.load(V + hk.to(tl.int64) * stride_vh + cols * stride_vn + offs_d[None, :], mask=col_ok[:, None],
                other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
    zero = tl.full([BLOCK_N, BLOCK_M], 0.0, dtype=tl.float32)
    offs_r = tl.arange(0, BLOCK_M)
    count = tl.load(KT_COUNT + kt)
    list_base = KT_LIST + kt.to(tl.int64) * NUM_QT
    for i in range(0, count):
        tile = tl.load(list_base + i)
        offs_m = tile * ROWS + offs_r
        row_ok = (offs_r < ROWS) & (offs_m < NB)
        row_lo, row_hi = _row_range(CS, CE, offs_m, row_ok, WINDOW, B)
        # transposed orientation: rows of the (BLOCK_N, BLOCK_M) tile are kv columns
        vis = _visible(offs_m[None, :], offs_n[:, None], row_lo[None, :], row_hi[None, :], S, WINDOW, B, CTX=True,
                       OWN=True, CAUSAL=CAUSAL)
        vis = vis & col_ok[:, None] & row_ok[None, :]
        rows = offs_m.to(tl.int64)[:, None]
        for g in range(0, GROUP):
            h = (hk * GROUP + g).to(tl.int64)
            q = tl.load(Q + h * stride_qh + rows * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + h * stride_doh + rows * stride_dom + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + h * NB + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + h * NB + offs_m, mask=row_ok, other=0.0)
            qk_t = _dot(k, tl.trans(q), zero, IEEE)
            p_t = tl.where(vis, tl.exp2(qk_t * qk_scale - lse[None, :]), 0.0)
            dv = _dot(p_t.to(do.dtype), do, dv, IEEE)
            dp_t = _dot(v, tl.trans(do), zero, IEEE)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = _dot(ds_t.to(q.dtype), q, dk, IEEE)
    dk = dk * sm_scale
    tl.store(DK + hk.to(tl.int64) * stride_dkh + cols * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=col_ok[:, None])
    tl.store(DV + hk.to(tl.int64) * stride_dvh + cols * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None])
