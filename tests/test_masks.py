"""The anchor-block mask (the serving rule, per query): dense reference invariants, context ranges, mask_mod, BlockMask, flex vs dense attention."""
import pytest
import torch
from hypothesis import given, settings, HealthCheck, strategies as st
from torch.nn.attention.flex_attention import create_mask, flex_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

from dflash_nb.masks import (anchor_block_block_mask, anchor_block_mask_mod, anchor_context_ranges, block_masks_equal,
                             dense_anchor_block_mask, ranges_to_dense)


@st.composite
def rows(draw, max_docs=5, max_len=24, max_anchors=7):
    "A packed row (docs of 1..max_len tokens, optional padding tail) with arbitrary anchors, keep flags and a layer kind."
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_docs))
    pad = draw(st.integers(0, 4))
    doc = torch.tensor(sum(([d] * n for d, n in enumerate(lens)), []) + [-1] * pad, dtype=torch.long)
    n_real = sum(lens)
    N = draw(st.integers(1, max_anchors))
    anchors = torch.tensor(draw(st.lists(st.integers(0, n_real - 1), min_size=N, max_size=N)), dtype=torch.long).sort().values
    keep = torch.tensor(draw(st.lists(st.booleans(), min_size=N, max_size=N)))
    B = draw(st.integers(1, 6))
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    causal = draw(st.booleans())
    return doc, anchors, keep, B, window, causal


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows())
def test_dense_mask_invariants(r):
    doc, anchors, keep, B, W, causal = r
    S, N = len(doc), len(anchors)
    m = dense_anchor_block_mask(anchors, keep, doc, B, W, causal)
    assert m.shape == (N * B, S + N * B) and m.dtype == torch.bool
    for q in range(N * B):
        j, k = divmod(q, B)
        a = int(anchors[j])
        ctx = m[q, :S].nonzero().flatten()
        own = m[q, S:].nonzero().flatten()
        # every row sees at least its own slot (no empty softmax row, no NaN)
        assert bool(m[q, S + q])
        # nothing crosses blocks; inside the block the serving rule on positions a + k, a + k2
        assert ((own // B) == j).all()
        slots = [k2 for k2 in range(B) if (not causal or k2 <= k) and (W is None or abs(k - k2) < W)]
        assert own.tolist() == [j * B + k2 for k2 in slots]
        if not keep[j]:
            assert ctx.numel() == 0          # padded block: own block only
            continue
        # no query sees the anchor's own context feature or anything after it, nothing crosses documents
        assert (ctx < a).all()
        assert (doc[ctx] == doc[a]).all()
        # the window is per query: the query sits at position a + k and sees c iff (a + k) - c < W
        if W is not None: assert ((a + k) - ctx < W).all()
        # and everything allowed is visible
        expect = [c for c in range(0, a) if doc[c] == doc[a] and (W is None or (a + k) - c < W)]
        assert ctx.tolist() == expect


@settings(max_examples=150, deadline=None)
@given(rows())
def test_ranges_mask_mod_and_dense_agree(r):
    doc, anchors, keep, B, W, causal = r
    S, N = len(doc), len(anchors)
    dense = dense_anchor_block_mask(anchors, keep, doc, B, W, causal)
    cs, ce = anchor_context_ranges(anchors, keep, doc, W)
    assert cs.dtype == ce.dtype == torch.int32 and (cs <= ce).all() and (ce <= S).all()
    assert ((cs == ce) | keep).all() and (cs[~keep] == ce[~keep]).all()
    assert torch.equal(ranges_to_dense(cs, ce, S, B, causal, W), dense)
    mm = anchor_block_mask_mod(anchors, keep, doc, B, W, causal)
    assert torch.equal(create_mask(mm, None, None, N * B, S + N * B, device="cpu")[0, 0], dense)


@settings(max_examples=60, deadline=None)
@given(rows(max_docs=6, max_len=60, max_anchors=12), st.sampled_from([128, 16, 8, (16, 32), (32, 8)]))
def test_block_mask_from_ranges_equals_create_block_mask(r, tile):
    doc, anchors, keep, B, W, causal = r
    t = (tile, tile) if isinstance(tile, int) else tile
    if B > min(t):
        with pytest.raises(ValueError, match="larger than the flex tile"):
            anchor_block_block_mask(anchors, keep, doc, B, W, causal, BLOCK_SIZE=tile)
        return
    fast = anchor_block_block_mask(anchors, keep, doc, B, W, causal, BLOCK_SIZE=tile)
    slow = anchor_block_block_mask(anchors, keep, doc, B, W, causal, BLOCK_SIZE=tile, method="mask_mod")
    assert block_masks_equal(fast, slow)
    assert torch.equal(fast.to_dense(), slow.to_dense())


def test_block_mask_has_full_tiles_and_equals_reference_at_scale():
    "A realistic row (S=2048, 128 anchors, B=16, tile 16) has empty, partial and full tiles, and both builds agree."
    g = torch.Generator().manual_seed(1)
    S, N, B = 2048, 128, 16
    doc = torch.arange(S) // 500
    anchors = torch.randperm(S - 1, generator=g)[:N].sort().values
    keep = torch.rand(N, generator=g) > 0.1
    for W, c in ((None, False), (256, True)):
        fast = anchor_block_block_mask(anchors, keep, doc, B, W, c, BLOCK_SIZE=16)
        slow = anchor_block_block_mask(anchors, keep, doc, B, W, c, BLOCK_SIZE=16, method="mask_mod")
        assert block_masks_equal(fast, slow)
        assert int(fast.full_kv_num_blocks.sum()) > 0 and int(fast.kv_num_blocks.sum()) > 0


def test_block_masks_equal_detects_a_difference():
    doc = torch.zeros(300, dtype=torch.long)
    a, k = torch.tensor([100, 200]), torch.tensor([True, True])
    m1 = anchor_block_block_mask(a, k, doc, 4, BLOCK_SIZE=16)
    assert block_masks_equal(m1, anchor_block_block_mask(a, k, doc, 4, BLOCK_SIZE=16, method="mask_mod"))
    m1a = anchor_block_block_mask(a[:1], k[:1], doc, 4, BLOCK_SIZE=16)
    assert not block_masks_equal(m1a, anchor_block_block_mask(torch.tensor([140]), k[:1], doc, 4, BLOCK_SIZE=16))
    assert not block_masks_equal(m1, anchor_block_block_mask(a, k, doc, 4, window=50, BLOCK_SIZE=16))
    assert not block_masks_equal(m1, anchor_block_block_mask(a, k, doc, 4, BLOCK_SIZE=32))


def _row(g, S, n_docs, N):
    "Random multi-document row: a padding tail, a 2-token document (shorter than a block), the first anchors at document starts."
    cuts = sorted(torch.randperm(S - 12, generator=g)[:n_docs - 1].add(1).unique().tolist())
    doc = torch.zeros(S, dtype=torch.long)
    for c in cuts: doc[c:] += 1
    doc[cuts[0] + 2:] += 1                                    # the document starting at cuts[0] has 2 tokens
    doc[S - 5:] = -1
    starts = [0, cuts[0], cuts[0] + 2]
    rest = [p for p in torch.randperm(S - 5, generator=g).tolist() if p not in starts][:N - len(starts)]
    anchors = torch.tensor(sorted(starts + rest))
    keep = torch.rand(N, generator=g) > 0.25
    keep[anchors == cuts[0]] = True; keep[anchors == 0] = True
    return doc, anchors, keep


@pytest.mark.parametrize("window,causal", [(None, False), (None, True), (7, True), (7, False), (1, True), (3, False)])
@pytest.mark.parametrize("B", [4, 16])
def test_flex_block_mask_attention_equals_dense(window, causal, B):
    g = torch.Generator().manual_seed(B * 31 + (window or 1))
    for trial in range(3):
        S, N, H, D = 97 + 13 * trial, 9, 4, 16
        doc, anchors, keep = _row(g, S, 4, N)
        q = torch.randn(1, H, N * B, D, generator=g)
        kv = torch.randn(2, 1, 2, S + N * B, D, generator=g)
        dense = dense_anchor_block_mask(anchors, keep, doc, B, window, causal)
        ref = torch.nn.functional.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=dense, enable_gqa=True)
        bm = anchor_block_block_mask(anchors, keep, doc, B, window, causal)
        out = flex_attention(q, kv[0], kv[1], block_mask=bm, enable_gqa=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_ranges_reject_non_contiguous_documents():
    with pytest.raises(ValueError, match="more than one run"):
        anchor_context_ranges(torch.tensor([1]), torch.tensor([True]), torch.tensor([0, 0, 1, 0]))
    cs, ce = anchor_context_ranges(torch.tensor([1]), torch.tensor([True]), torch.tensor([0, 0, 1, 0]), check=False)
    assert (cs.item(), ce.item()) == (0, 1)


def test_positions_not_tiles():
    "A key after the anchor but in the anchor's own 128-tile stays invisible (the block-index leak)."
    doc = torch.zeros(256, dtype=torch.long)
    m = dense_anchor_block_mask(torch.tensor([70]), torch.tensor([True]), doc, 4)
    assert m[:, :70].all() and not m[:, 70:256].any()
    bm = anchor_block_block_mask(torch.tensor([70]), torch.tensor([True]), doc, 4)
    q = torch.randn(1, 1, 4, 8); k = torch.randn(1, 1, 260, 8); v = torch.randn(1, 1, 260, 8)
    v2 = v.clone(); v2[:, :, 70:128] += 100.0                   # change keys after the anchor inside its tile
    out, out2 = flex_attention(q, k, v, block_mask=bm), flex_attention(q, k, v2, block_mask=bm)
    torch.testing.assert_close(out, out2)
