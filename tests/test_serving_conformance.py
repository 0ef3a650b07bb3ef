"""Serving conformance: the serving side is the judge. Drafters made by dflash_nb are exported, loaded by the DFlash
authors' own inference code (the PyPI `dflash` package, `dflash.model.DFlashDraftModel`), and must give the same hidden
states, logits and greedy decodes as dflash_nb's training-time forward: all-full layers, the flagship layout
[sliding x 4, full] past anchor W - B + 1, small windows before and after W - B + 1, W < B, GQA, YaRN RoPE, bf16.

`dflash` 0.1.0 pins tqdm/requests/datasets and an older transformers for its CLI; its model module needs only torch and
transformers, so `make install` installs it with `--no-deps` (see the Makefile)."""
import pytest
import torch

import dflash.model as dflash_model   # the serving reference; `make install` installs it (a missing one fails the suite)

from dflash_nb.anchors import block_input_ids, block_position_ids
from dflash_nb.attention import AnchorBlockLayout
from dflash_nb.decoding import speculative_generate
from dflash_nb.export import export_drafter
from dflash_nb.model import DFlashDrafter, DrafterConfig
from dflash_nb.target import tiny_target

MASK_ID = 151669
FP32_ATOL = 1e-5   # hidden states, fp32: float32 round-off, nothing more


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(2)
    return tiny_target()


def make_drafter(target, dtype=torch.float32, seed=0, **kw):
    "A drafter with every weight distinct (not the init values), exported and loaded back by the dflash package."
    kw = {"num_hidden_layers": 2, "block_size": 4, "target_layer_ids": [0, 2, 4],
          "mask_token_id": min(MASK_ID, target.config.vocab_size - 1), **kw}
    cfg = DrafterConfig.from_target(target.config, **kw)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()).eval()
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad: p.add_(torch.randn_like(p) * 0.05)
    return d.to(dtype)


def load_served(drafter, tmp_path, dtype=torch.float32):
    out = export_drafter(drafter, drafter.config, tmp_path / "export", dtype=dtype)
    served = dflash_model.DFlashDraftModel.from_pretrained(str(out), attn_implementation="sdpa", dtype=dtype).eval()
    assert served.block_size == drafter.config.block_size and served.mask_token_id == drafter.config.mask_token_id
    assert list(served.target_layer_ids) == list(drafter.config.target_layer_ids)
    return served


def ours(drafter, features, doc, pos, ids, anchors):
    "dflash_nb's training-time forward: every anchor of the packed row at once, (N, B, H) hidden states."
    B = drafter.config.block_size
    keep = torch.ones(len(anchors), dtype=torch.bool)
    a = torch.tensor(anchors)
    with torch.no_grad():
        h = drafter(features, pos, block_input_ids(ids, a, keep, B, MASK_ID), block_position_ids(pos, a, B),
                    AnchorBlockLayout(a, keep, doc, B))
    return h.view(len(anchors), B, -1)


def served_block(served, target, features, doc, pos, ids, anchor, B):
    "The dflash package's forward for one block, exactly as dflash_generate calls it: the anchor's document up to it."
    same = torch.nonzero(doc == doc[anchor]).flatten()
    start = int(same[0])
    ctx = features[start:anchor][None]
    block = torch.full((1, B), MASK_ID, dtype=torch.long); block[0, 0] = ids[anchor]
    noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight).to(ctx.dtype)
    p0 = int(pos[anchor])
    with torch.no_grad():
        h = served(target_hidden=ctx, noise_embedding=noise, position_ids=torch.arange(p0 - ctx.shape[1], p0 + B)[None])
        return h[0], served.compute_logits(h, target.get_output_embeddings())[0]


def packed_row(S_docs, n_feat, seed=0):
    "Several documents packed in one row: (features, doc ids, per-document positions, token ids)."
    g = torch.Generator().manual_seed(seed)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(S_docs)])
    pos = torch.cat([torch.arange(n) for n in S_docs])
    ids = torch.randint(0, 151000, (len(doc),), generator=g)
    feats = torch.randn(len(doc), n_feat, generator=g)
    return feats, doc, pos, ids


def check(target, drafter, served, S_docs, anchors, atol=FP32_ATOL, logit_atol=None, seed=0):
    B = drafter.config.block_size
    feats, doc, pos, ids = packed_row(S_docs, drafter.config.feature_size, seed)
    feats = feats.to(next(drafter.parameters()).dtype)
    h = ours(drafter, feats, doc, pos, ids, anchors)
    for j, a in enumerate(anchors):
        hs, ls = served_block(served, target, feats, doc, pos, ids, a, B)
        err = (h[j].float() - hs.float()).abs().max().item()
        assert err <= atol, f"anchor {a}: hidden states differ by {err:.3g} > {atol}"
        if logit_atol is not None:
            lo = drafter.logits(h[j]).float()
            assert (lo - ls.float()).abs().max().item() <= logit_atol, f"anchor {a}: logits differ"
            assert torch.equal(lo.argmax(-1), ls.float().argmax(-1)), f"anchor {a}: greedy drafts differ"


def test_all_full_layers(target, tmp_path):
    d = make_drafter(target, layer_types=["full", "full"])
    check(target, d, load_served(d, tmp_path), [23, 17], [0, 5, 22, 23, 30, 39], logit_atol=1e-4)


@pytest.mark.parametrize("W,B", [(6, 4), (4, 4), (3, 8), (1, 4), (9, 8)])
def test_small_windows_before_and_after_W_minus_B_plus_1(target, tmp_path, W, B):
    "Anchors on both sides of W - B + 1 (where a per-block window starts to differ), W < B and W = 1 included."
    d = make_drafter(target, layer_types=["sliding", "full"], sliding_window=W, block_size=B)
    first = max(W - B + 1, 0)
    anchors = sorted({0, 1, first, first + 1, W, W + 3, 20, 31} - {32})
    check(target, d, load_served(d, tmp_path), [32, 12], anchors + [33, 40], logit_atol=1e-4)


def test_sliding_not_causal_config(target, tmp_path):
    "A sliding layer served non-causally (`is_causal: false` in config.json): the window applies on both sides."
    d = make_drafter(target, layer_types=["sliding", "sliding"], sliding_window=3, block_size=8)
    for layer in d.layers: layer.self_attn.causal_in_block = False
    out = export_drafter(d, d.config, tmp_path / "export")
    import json
    cfg = json.loads((out / "config.json").read_text()); cfg["is_causal"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    served = dflash_model.DFlashDraftModel.from_pretrained(str(out), attn_implementation="sdpa", dtype=torch.float32)
    check(target, d, served.eval(), [30], [0, 2, 9, 29])


def test_gqa_and_yarn_rope(tmp_path):
    "GQA 4:1 and YaRN RoPE scaling, on a target configured with them."
    t = tiny_target(num_heads=8, num_kv_heads=2, rope_parameters={"rope_type": "yarn", "rope_theta": 1_000_000.0,
                                                                  "factor": 4.0, "original_max_position_embeddings": 64})
    d = make_drafter(t, layer_types=["sliding", "full"], sliding_window=10)
    assert d.config.num_attention_heads == 8 and d.config.num_key_value_heads == 2
    assert (d.config.rope_scaling or {}).get("rope_type") == "yarn"
    check(t, d, load_served(d, tmp_path), [150], [3, 60, 100, 149], logit_atol=1e-4)


@pytest.mark.slow
def test_flagship_layout_past_anchor_2033(target, tmp_path):
    "The published Qwen3.6-27B drafter's layout: 4 sliding (W = 2048) + 1 full, B = 16, anchors up to 3000."
    d = make_drafter(target, num_hidden_layers=5, layer_types=["sliding"] * 4 + ["full"], sliding_window=2048,
                     block_size=16)
    served = load_served(d, tmp_path)
    check(target, d, served, [3100], [5, 2000, 2033, 2034, 2040, 2600, 3080], logit_atol=1e-4)


def test_bf16(tmp_path):
    "bf16 target, weights and activations on both sides: hidden states within bf16 rounding of each other."
    t = tiny_target(dtype=torch.bfloat16)
    d = make_drafter(t, dtype=torch.bfloat16, layer_types=["sliding", "full"], sliding_window=5)
    served = load_served(d, tmp_path, dtype=torch.bfloat16)
    # bf16 keeps 8 significant bits: two op orders may differ by a few ulps of the hidden states' scale (|h| ~ 1..4)
    check(t, d, served, [40], [0, 3, 9, 20, 39], atol=0.1)


def test_per_block_window_would_differ(target, tmp_path, monkeypatch):
    "The control: a drafter that windowed per block (the old rule) differs from serving past W - B + 1."
    import dflash_nb.attention as A
    d = make_drafter(target, layer_types=["sliding", "sliding"], sliding_window=6, block_size=4)
    served = load_served(d, tmp_path)
    check(target, d, served, [30], [20])
    old = A.dense_anchor_block_mask

    def per_block(anchors, keep, doc_ids, B, window=None, causal=False):
        m = old(anchors, keep, doc_ids, B, None, causal)
        if window is not None:
            S = doc_ids.shape[0]
            a = anchors.long().repeat_interleave(B)
            m[:, :S] &= torch.arange(S)[None] >= (a - window)[:, None]
        return m
    monkeypatch.setattr(A, "dense_anchor_block_mask", per_block)   # fault injection: the sdpa path's mask
    with pytest.raises(AssertionError, match="hidden states differ"):
        check(target, d, served, [30], [20])


@pytest.mark.parametrize("layer_types,W", [(["full", "full"], None), (["sliding", "full"], 5)])
@pytest.mark.parametrize("drafts", ["random", "always-right"])
def test_greedy_decode_equals_dflash_generate(tmp_path, monkeypatch, layer_types, W, drafts):
    """A whole greedy decode: the dflash package's `dflash_generate` and dflash_nb's speculative loop give the same tokens
    and the same committed length in every cycle, with the same exported drafter. A random drafter is rejected at once
    (every cycle commits 1 token: the rejection path); with the target's and the drafter's final norms zeroed both
    always pick token 0, so every draft is accepted (the full-acceptance path, caches cropped after whole blocks)."""
    target = tiny_target(vocab_size=2048, pad_token_id=0, eos_token_id=1)
    kw = dict(layer_types=layer_types, block_size=4, target_layer_ids=[1, 3, 4])
    if W: kw["sliding_window"] = W
    d = make_drafter(target, **kw)
    if drafts == "always-right":
        with torch.no_grad(): target.model.norm.weight.zero_(); d.norm.weight.zero_()
    served = load_served(d, tmp_path)
    # its statistics time the decode with torch.cuda.synchronize(); on a CPU machine time it with the plain clock
    import time
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    g = torch.Generator().manual_seed(3)
    for trial in range(2):
        prompt = torch.randint(2, 2000, (8 + 5 * trial,), generator=g)
        ref = dflash_model.dflash_generate(served, target, prompt[None], 14, None, return_stats=True)
        theirs = ref.output_ids[0, prompt.numel():]
        mine = speculative_generate(d, target, prompt, 14, cache="dynamic")
        assert torch.equal(mine["tokens"], theirs), (mine["tokens"], theirs)
        assert mine["accept_lengths"] == ref.acceptance_lengths, (mine["accept_lengths"], ref.acceptance_lengths)
        expect = 1 if drafts == "random" else 4
        assert max(mine["accept_lengths"]) == expect, mine["accept_lengths"]


def test_with_modeling_code_autoModel_returns_the_drafter(target, tmp_path):
    """`export --with-modeling-code`: `AutoModel.from_pretrained(dir, trust_remote_code=True)` returns the drafter, which
    agrees with dflash_nb and with the dflash package; plain AutoModel builds a Qwen3 decoder (the wrong model)."""
    from transformers import AutoModel
    d = make_drafter(target, layer_types=["sliding", "full"], sliding_window=6, block_size=4)
    out = export_drafter(d, d.config, tmp_path / "with_code", with_modeling_code=True)
    code = (out / "modeling_dflash.py").read_text()
    assert "dflash_nb" not in code and "import dflash" not in code       # self-contained: torch + transformers only
    auto = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(auto).__name__ == "DFlashDraftModel" and type(auto).__module__.endswith("modeling_dflash")
    check(target, d, auto, [30, 10], [0, 3, 9, 29, 35])
    check(target, d, load_served(d, tmp_path), [30, 10], [0, 3, 9, 29, 35])
    plain = AutoModel.from_pretrained(str(out), dtype=torch.float32)    # what a user gets without the flag
    assert type(plain).__name__ == "Qwen3Model"
