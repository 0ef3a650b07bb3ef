"""Packing and anchors: whole-sample packing, valid anchors, sampling, block labels/positions/inputs."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dflash_nb.anchors import (anchor_block_labels, block_input_ids, block_position_ids, make_packed_row, pack_samples,
                               sample_anchors, valid_anchor_mask)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=60), st.integers(1, 64))
def test_pack_samples_whole_samples_within_capacity(lengths, cap):
    groups = pack_samples(lengths, cap)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))     # every sample exactly once, never split
    for g in groups:
        assert g == sorted(g)
        assert sum(lengths[i] for i in g) <= cap or len(g) == 1                 # overlong samples ride alone
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    assert pack_samples(lengths, cap) == groups                                  # deterministic


def test_pack_samples_fills_rows():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, 2000, (3000,), generator=g).tolist()
    groups = pack_samples(lengths, 8192)
    fill = sum(lengths) / (len(groups) * 8192)
    assert fill > 0.97, fill
    with pytest.raises(ValueError): pack_samples([1], 0)


def _random_row(g, n_docs=5, max_len=40, pad=7):
    samples = []
    for _ in range(n_docs):
        n = int(torch.randint(1, max_len, (1,), generator=g))
        samples.append(dict(input_ids=torch.randint(0, 1000, (n,), generator=g).tolist(),
                            loss_mask=(torch.rand(n, generator=g) > 0.3).long().tolist()))
    total = sum(len(s["input_ids"]) for s in samples)
    return samples, make_packed_row(samples, max_tokens=total + pad)


def test_make_packed_row_layout():
    g = torch.Generator().manual_seed(1)
    samples, row = _random_row(g)
    S = row["input_ids"].shape[0]
    assert {k: (v.dtype, v.shape) for k, v in row.items()} == {
        "input_ids": (torch.long, (S,)), "loss_mask": (torch.bool, (S,)), "doc_ids": (torch.long, (S,)), "position_ids": (torch.long, (S,))}
    off = 0
    for d, s in enumerate(samples):
        n = len(s["input_ids"])
        assert row["input_ids"][off:off + n].tolist() == s["input_ids"]
        assert row["loss_mask"][off:off + n].long().tolist() == s["loss_mask"]
        assert (row["doc_ids"][off:off + n] == d).all()
        assert row["position_ids"][off:off + n].tolist() == list(range(n))
        off += n
    assert (row["doc_ids"][off:] == -1).all() and not row["loss_mask"][off:].any() and (row["position_ids"][off:] == 0).all()


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 16), st.integers(1, 40))
def test_sample_anchors_valid_sorted_padded(seed, B, max_anchors):
    g = torch.Generator().manual_seed(seed)
    _, row = _random_row(g)
    lm, doc = row["loss_mask"], row["doc_ids"]
    anchors, keep = sample_anchors(lm, doc, B, max_anchors, generator=g)
    assert anchors.shape == keep.shape == (max_anchors,) and anchors.dtype == torch.long and keep.dtype == torch.bool
    valid = [a for a in range(len(lm) - 1) if lm[a] and lm[a + 1] and doc[a] == doc[a + 1] and doc[a] >= 0]
    n = min(max_anchors, len(valid))
    assert keep.tolist() == [True] * n + [False] * (max_anchors - n)             # kept first, padding last
    kept = anchors[keep].tolist()
    assert all(a in valid for a in kept)                                          # only valid positions
    assert kept == sorted(set(kept))                                              # sorted, without replacement
    assert valid_anchor_mask(lm, doc).nonzero().flatten().tolist() == valid


def test_sample_anchors_seeded_and_resampled():
    lm, doc = torch.ones(4096, dtype=torch.bool), torch.arange(4096) // 500
    a1, k1 = sample_anchors(lm, doc, 16, 64, generator=torch.Generator().manual_seed(3))
    a2, k2 = sample_anchors(lm, doc, 16, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and torch.equal(k1, k2)
    g = torch.Generator().manual_seed(3)
    draws = [sample_anchors(lm, doc, 16, 64, generator=g)[0] for _ in range(3)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    b1, b2 = sample_anchors(lm, doc, 16, 64)[0], sample_anchors(lm, doc, 16, 64)[0]   # global RNG: resampled too
    assert not torch.equal(b1, b2)


def test_sample_anchors_uniform():
    "Every valid position is drawn about equally often (without replacement, 5 of 20 per draw)."
    lm = torch.tensor([0, 0] + [1] * 21 + [0, 0], dtype=torch.bool)
    doc = torch.zeros(25, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(25)
    for _ in range(4000):
        a, k = sample_anchors(lm, doc, 4, 5, generator=g)
        counts[a[k]] += 1
    valid = counts[2:22]
    assert counts.sum() == 20000 and counts[:2].sum() == 0 and counts[22:].sum() == 0
    assert (valid - 1000).abs().max() < 120, valid                # expected 1000 each, sd ~27


def test_sample_anchors_no_valid_and_bad_block():
    lm, doc = torch.zeros(10, dtype=torch.bool), torch.zeros(10, dtype=torch.long)
    a, k = sample_anchors(lm, doc, 4, 3)
    assert not k.any() and a.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="block_size"):
        sample_anchors(lm, doc, 1, 3)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 12))
def test_block_labels_valid_only_inside_document_and_loss(seed, B):
    g = torch.Generator().manual_seed(seed)
    _, row = _random_row(g, pad=3)
    x, lm, doc, pos = row["input_ids"], row["loss_mask"], row["doc_ids"], row["position_ids"]
    S = len(x)
    anchors, keep = sample_anchors(lm, doc, B, 12, generator=g)
    labels, valid = anchor_block_labels(x, lm, doc, anchors, keep, B)
    assert labels.shape == valid.shape == (12, B)
    for j in range(12):
        a = int(anchors[j])
        for k in range(B):
            p = a + k
            assert labels[j, k] == (x[p] if p < S else 0)
            expect = bool(keep[j]) and k >= 1 and p < S and doc[p] == doc[a] and bool(lm[p])
            assert bool(valid[j, k]) == expect, (j, k)
        if keep[j]: assert valid[j, 1]                          # a valid anchor always trains slot 1
    bp = block_position_ids(pos, anchors, B).view(12, B)
    assert torch.equal(bp, pos[anchors][:, None] + torch.arange(B))
    bi = block_input_ids(x, anchors, keep, B, 151_669).view(12, B)
    assert (bi[:, 1:] == 151_669).all()
    assert torch.equal(bi[:, 0], torch.where(keep, x[anchors], torch.full_like(anchors, 151_669)))


def test_labels_never_cross_documents():
    "Anchor 2 tokens before a document boundary: slots past it carry labels of the next document but zero weight."
    row = make_packed_row([dict(input_ids=[1, 2, 3, 4], loss_mask=[1, 1, 1, 1]),
                           dict(input_ids=[5, 6, 7, 8], loss_mask=[1, 1, 1, 1])])
    labels, valid = anchor_block_labels(row["input_ids"], row["loss_mask"], row["doc_ids"], torch.tensor([2]), torch.tensor([True]), 4)
    assert labels.tolist() == [[3, 4, 5, 6]] and valid.tolist() == [[False, True, False, False]]


def test_sample_anchors_large_row():
    "A 64K-token row with 4096 anchor slots: exactly 4096 distinct valid anchors, sorted."
    g = torch.Generator().manual_seed(5)
    lm = torch.rand(65536, generator=g) > 0.2
    doc = torch.arange(65536) // 3000
    a, k = sample_anchors(lm, doc, 16, 4096, generator=g)
    assert k.all() and (a.diff() > 0).all() and valid_anchor_mask(lm, doc)[a].all()
