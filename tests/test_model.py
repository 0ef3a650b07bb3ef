"""The DFlash drafter (dflash_nb.model): config from a target, mask-token choice, the forward against a naive
one-query-at-a-time reference, what the layers see, and the frozen shared embedding / lm_head."""
import math, types
import pytest, torch
from torch import nn
from transformers import Qwen3Config, Qwen3_5TextConfig, Qwen3_5Config
from dflash_nb.config import from_dict, to_dict, ConfigError
from dflash_nb.model import DrafterConfig, DFlashDrafter, resolve_mask_token_id
from dflash_nb.target import tiny_target, TargetFeatures
from dflash_nb.attention import AnchorBlockLayout
from dflash_nb.anchors import block_input_ids, block_position_ids

MASK = 151669


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def tok():
    from dflash_nb.records import qwen3_tokenizer_dir, load_tokenizer
    return load_tokenizer(qwen3_tokenizer_dir())


def make_drafter(target, seed=0, **overrides):
    kw = dict(num_hidden_layers=2, layer_types=["sliding", "full"], sliding_window=5, target_layer_ids=[1, 2, 3],
              block_size=4, mask_token_id=MASK, num_attention_heads=4, num_key_value_heads=2)
    cfg = DrafterConfig.from_target(target.config, **{**kw, **overrides})
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())


def make_row(target, B, seed=0):
    """Two documents (12 and 3 tokens, the second shorter than a block) + 2 padding; anchors include a document start,
    a block running past its document's end, and a padded anchor."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.tensor([0] * 12 + [1] * 3 + [-1] * 2)
    input_ids = torch.randint(0, 151669, (17,), generator=g)
    position_ids = torch.tensor(list(range(12)) + list(range(3)) + [0, 0])
    anchors = torch.tensor([0, 4, 10, 12, 13, 0])
    keep = torch.tensor([True, True, True, True, True, False])
    feats = TargetFeatures(target, [1, 2, 3])(input_ids, doc_ids)
    return dict(features=feats, context_position_ids=position_ids,
                block_input_ids=block_input_ids(input_ids, anchors, keep, B, MASK),
                block_position_ids=block_position_ids(position_ids, anchors, B),
                layout=AnchorBlockLayout(anchors, keep, doc_ids, B)), (anchors, keep, doc_ids)


def naive_drafter(d, features, context_position_ids, block_input_ids, block_position_ids, anchors, keep, doc_ids):
    """The drafter written out from its raw weights (plain RoPE, RMSNorm, SwiGLU by hand), one query at a time,
    with the serving visibility rule (chapter 03) spelled out as key lists."""
    B, S, cfg = d.config.block_size, features.shape[0], d.config
    eps, D = cfg.rms_norm_eps, cfg.head_dim
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2).float() / D)
    def rope(x, pos):  # x (L, heads, D): rotate pairs (i, i + D/2) by pos * inv_freq[i]
        ang = pos.float()[:, None] * inv_freq
        c, s_ = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)
    ctx = rms(features @ d.fc.weight.T, d.hidden_norm.weight)
    h = d.embed_tokens.weight[block_input_ids].float()
    kv_pos = torch.cat([context_position_ids, block_position_ids])
    for layer in d.layers:
        at = layer.self_attn
        x = rms(h, layer.input_layernorm.weight)
        kv_in = torch.cat([ctx, x])
        q = rope(rms((x @ at.q_proj.weight.T).view(len(x), -1, D), at.q_norm.weight), block_position_ids).transpose(0, 1)
        k = rope(rms((kv_in @ at.k_proj.weight.T).view(len(kv_in), -1, D), at.k_norm.weight), kv_pos).transpose(0, 1)
        v = (kv_in @ at.v_proj.weight.T).view(len(kv_in), -1, D).transpose(0, 1)
        rep = at.nh // at.nkv
        out = torch.zeros(at.nh, h.shape[0], at.D)
        for j, a in enumerate(anchors.tolist()):
            for s in range(B):
                p = a + s                                     # the query's position, as served
                ctx_keys = [c for c in range(S) if keep[j] and c < a and doc_ids[c] == doc_ids[a]
                            and (at.window is None or p - c < at.window)]
                own = [S + j * B + t for t in range(B) if (not at.causal_in_block or t <= s)
                       and (at.window is None or abs(s - t) < at.window)]
                keys = torch.tensor(ctx_keys + own)
                for hh in range(at.nh):
                    sc = q[hh, j * B + s] @ k[hh // rep, keys].T / math.sqrt(at.D)
                    out[hh, j * B + s] = sc.softmax(-1) @ v[hh // rep, keys]
        h = h + out.transpose(0, 1).reshape(h.shape[0], -1) @ at.o_proj.weight.T
        y = rms(h, layer.post_attention_layernorm.weight)
        m = layer.mlp
        h = h + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return rms(h, d.norm.weight)


# ---------------------------------------------------------------- config

QWEN3_8B = Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       intermediate_size=12288, num_hidden_layers=36, vocab_size=151936, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def test_from_target_defaults_and_overrides():
    c = DrafterConfig.from_target(QWEN3_8B)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (4096, 32, 8, 128, 12288)
    assert (c.rope_theta, c.rope_scaling, c.rms_norm_eps, c.vocab_size, c.num_target_layers) == (1e6, None, 1e-6, 151936, 36)
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.layer_types == ["full"] * 5 and c.block_size == 16
    c = DrafterConfig.from_target(QWEN3_8B, hidden_size=None, num_key_value_heads=4, num_target_features=3, block_size=10)
    assert (c.hidden_size, c.num_key_value_heads, c.target_layer_ids, c.block_size) == (4096, 4, [1, 17, 33], 10)
    assert DrafterConfig.from_target(QWEN3_8B, target_layer_ids=[2, 3]).num_target_features == 2
    with pytest.raises(TypeError, match="unknown DrafterConfig fields"):
        DrafterConfig.from_target(QWEN3_8B, hidden=1)
    with pytest.raises(ValueError, match="not a multiple"):
        DrafterConfig.from_target(QWEN3_8B, num_key_value_heads=5)
    with pytest.raises(ValueError, match="unknown layer types"):
        DrafterConfig.from_target(QWEN3_8B, layer_types=["full"] * 4 + ["local"])
    with pytest.raises(ValueError, match="fields unset"):
        DrafterConfig().validate()


def test_from_target_qwen3_6_27b_layout_and_multimodal_wrapper():
    text = Qwen3_5TextConfig(num_hidden_layers=64, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                             num_key_value_heads=4, head_dim=256, vocab_size=248320,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    for hf in (text, Qwen3_5Config(text_config=text.to_dict())):
        c = DrafterConfig.from_target(hf, layer_types=["sliding"] * 4 + ["full"], sliding_window=2048)
        assert c.target_layer_ids == [1, 16, 31, 46, 61]
        assert (c.hidden_size, c.head_dim, c.num_key_value_heads, c.vocab_size, c.rope_theta) == (5120, 256, 4, 248320, 1e7)
        assert c.rope_scaling is None  # the hybrid's partial rotary belongs to its own attention, not the drafter's


def test_from_target_rope_scaling_v5_and_v4_styles():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    v5 = Qwen3Config(num_hidden_layers=36, rope_parameters={"rope_theta": 1e6, **yarn})
    assert DrafterConfig.from_target(v5).rope_scaling == yarn
    v4 = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                               num_hidden_layers=8, vocab_size=1000, rms_norm_eps=1e-5, max_position_embeddings=4096,
                               rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    c = DrafterConfig.from_target(v4)
    assert (c.rope_theta, c.rope_scaling, c.rms_norm_eps) == (5e5, {"rope_type": "linear", "factor": 2.0}, 1e-5)
    # the scaling reaches the rotary embedding: linear factor 2 halves the frequencies
    emb = nn.Embedding(1000, 64); head = nn.Linear(64, 1000, bias=False)
    d1 = DFlashDrafter(c, emb, head)
    d0 = DFlashDrafter(DrafterConfig.from_target(v4, rope_scaling={"rope_type": "default"}), emb, head)
    torch.testing.assert_close(d1.rotary_emb.inv_freq * 2, d0.rotary_emb.inv_freq)


def test_config_yaml_round_trip():
    c = DrafterConfig.from_target(QWEN3_8B, layer_types=["sliding", "full", "full", "full", "full"])
    assert from_dict(DrafterConfig, to_dict(c)) == c
    with pytest.raises(ConfigError, match="layer_types"):
        from_dict(DrafterConfig, {"layer_types": ["global"]})
    with pytest.raises(ConfigError, match="unknown config key"):
        from_dict(DrafterConfig, {"n_layers": 2})


def test_resolve_mask_token_id(tok):
    assert (len(tok), tok.mask_token_id) == (151669, None)
    assert resolve_mask_token_id(tok, 151936) == 151669                  # first unused embedding row
    assert resolve_mask_token_id(tok, 151936, explicit=151700) == 151700
    assert resolve_mask_token_id(None, 151936, explicit=5) == 5
    for bad in (tok.pad_token_id, tok.eos_token_id):
        with pytest.raises(ValueError, match="pad/eos"):
            resolve_mask_token_id(tok, 151936, explicit=bad)
    with pytest.raises(ValueError, match="outside the embedding"):
        resolve_mask_token_id(tok, 151936, explicit=151936)
    with pytest.raises(ValueError, match="pass mask_token_id explicitly"):
        resolve_mask_token_id(tok, 151669)                               # every row used, no mask token
    with pytest.raises(ValueError, match="no tokenizer"):
        resolve_mask_token_id(None, 151936)


def test_resolve_mask_token_id_uses_tokenizer_mask_token(tok):
    import copy
    t = copy.deepcopy(tok)
    t.add_special_tokens({"mask_token": "<|MASK|>"})                     # what z-lab's README does
    assert resolve_mask_token_id(t, 151936) == t.mask_token_id == 151669
    t2 = copy.deepcopy(tok)
    t2.mask_token = t2.eos_token                                          # a misconfigured tokenizer
    with pytest.raises(ValueError, match="pad/eos"):
        resolve_mask_token_id(t2, 151936)


# ---------------------------------------------------------------- forward

@pytest.mark.parametrize("layer_types", [["sliding", "full"], ["full", "full"], ["sliding", "sliding"]])
def test_forward_equals_naive_reference(target, layer_types):
    d = make_drafter(target, layer_types=layer_types)
    inputs, (anchors, keep, doc_ids) = make_row(target, d.config.block_size)
    h = d(**inputs)
    assert h.shape == (6 * 4, 64)
    ref = naive_drafter(d, *[inputs[k] for k in ("features", "context_position_ids", "block_input_ids", "block_position_ids")],
                        anchors, keep, doc_ids)
    torch.testing.assert_close(h, ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(h).all()


def test_context_is_fused_once_and_layers_see_context_plus_block(target):
    d = make_drafter(target, num_hidden_layers=3, layer_types=["full"] * 3)
    inputs, _ = make_row(target, 4)
    seen = {}
    def rec(name):
        def hook(mod, args, out):
            seen.setdefault(name, []).append((args[0].detach().clone(), out.detach().clone()))
        return hook
    hs = [d.fc.register_forward_hook(rec("fc")), d.hidden_norm.register_forward_hook(rec("hidden_norm"))]
    for i, layer in enumerate(d.layers):
        for n in ("q_proj", "k_proj", "v_proj"):
            hs.append(getattr(layer.self_attn, n).register_forward_hook(rec(f"{i}.{n}")))
        hs.append(layer.input_layernorm.register_forward_hook(rec(f"{i}.ln")))
    try:
        d(**inputs)
    finally:
        for h in hs: h.remove()
    assert len(seen["fc"]) == 1 and len(seen["hidden_norm"]) == 1        # once per forward, not per layer
    torch.testing.assert_close(seen["fc"][0][0], inputs["features"])
    ctx = seen["hidden_norm"][0][1]
    S, NB = 17, 24
    for i in range(3):
        x = seen[f"{i}.ln"][0][1]
        q_in = seen[f"{i}.q_proj"][0][0]
        assert q_in.shape == (NB, 64) and torch.equal(q_in, x)             # queries: block tokens only
        for n in ("k_proj", "v_proj"):
            kv_in = seen[f"{i}.{n}"][0][0]
            assert kv_in.shape == (S + NB, 64)
            assert torch.equal(kv_in[:S], ctx) and torch.equal(kv_in[S:], x)  # [context ; block], same ctx every layer


def test_mask_semantics_through_the_model(target):
    B = 4
    inputs, (anchors, keep, doc_ids) = make_row(target, B)
    full = make_drafter(target, layer_types=["full", "full"])
    slid = make_drafter(target, layer_types=["sliding", "sliding"], sliding_window=3)
    for d in (full, slid):
        h = d(**inputs)
        # another document's features never matter: change document 1 → blocks of document 0 (anchors 0, 4, 10) unchanged
        f = inputs["features"].clone(); f[12:15] += 3.0
        h2 = d(**{**inputs, "features": f})
        torch.testing.assert_close(h2[:3 * B], h[:3 * B], rtol=0, atol=1e-6)
        assert not torch.allclose(h2[4 * B:5 * B], h[4 * B:5 * B], atol=1e-3)   # anchor 13 sees position 12
        # features at and after the anchor never matter (anchor 4: positions 4..)
        f = inputs["features"].clone(); f[4:12] += 3.0
        torch.testing.assert_close(d(**{**inputs, "features": f})[B:2 * B], h[B:2 * B], rtol=0, atol=1e-6)
        # a block never sees another block
        ids = inputs["block_input_ids"].clone(); ids[2 * B + 1] = 7
        h3 = d(**{**inputs, "block_input_ids": ids})
        torch.testing.assert_close(torch.cat([h3[:2 * B], h3[3 * B:]]), torch.cat([h[:2 * B], h[3 * B:]]), rtol=0, atol=1e-6)
    # sliding window: anchor 10 with W=3 sees context 8..9 at most (slot 0); full layers see 0..9
    f = inputs["features"].clone(); f[5] += 3.0
    torch.testing.assert_close(slid(**{**inputs, "features": f})[2 * B:3 * B], slid(**inputs)[2 * B:3 * B], rtol=0, atol=1e-6)
    assert not torch.allclose(full(**{**inputs, "features": f})[2 * B:3 * B], full(**inputs)[2 * B:3 * B], atol=1e-3)
    # causal inside the block (sliding layers only): changing slot 2 leaves slots 0, 1 of that block alone
    ids = inputs["block_input_ids"].clone(); ids[B + 2] = 9
    hs, hf = slid(**{**inputs, "block_input_ids": ids}), full(**{**inputs, "block_input_ids": ids})
    torch.testing.assert_close(hs[B:B + 2], slid(**inputs)[B:B + 2], rtol=0, atol=1e-6)
    assert not torch.allclose(hf[B:B + 2], full(**inputs)[B:B + 2], atol=1e-3)


def test_rope_positions_follow_documents(target):
    "Shifting a whole document to another place in the row (same per-document positions) changes nothing."
    d = make_drafter(target)
    inputs, (anchors, keep, doc_ids) = make_row(target, 4)
    # move document 1 (positions 12..14) in front of document 0
    perm = torch.tensor(list(range(12, 15)) + list(range(12)) + [15, 16])
    inv = torch.empty_like(perm); inv[perm] = torch.arange(17)
    new_anchors = inv[anchors]
    new_doc = doc_ids[perm]
    moved = dict(inputs, features=inputs["features"][perm], context_position_ids=inputs["context_position_ids"][perm],
                 layout=AnchorBlockLayout(new_anchors, keep, new_doc, 4))
    torch.testing.assert_close(d(**moved), d(**inputs), rtol=1e-5, atol=1e-5)


def test_flex_backend_forward_matches_sdpa(target):
    d = make_drafter(target)
    inputs, _ = make_row(target, 4)
    with torch.no_grad():
        torch.testing.assert_close(d(**inputs, backend="flex"), d(**inputs, backend="sdpa"), rtol=1e-5, atol=1e-5)


def test_bf16_autocast_forward_and_backward(target):
    d = make_drafter(target)
    inputs, _ = make_row(target, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = d(**inputs)
        loss = d.logits(h).float().logsumexp(-1).mean()
    loss.backward()
    ref = d(**inputs)
    assert torch.isfinite(h).all() and (h.float() - ref).abs().max() < 0.1
    assert all(p.grad is not None for p in d.parameters())


# ---------------------------------------------------------------- frozen shared modules, state dicts

EXPORT_LAYER_NAMES = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                      "input_layernorm.weight", "post_attention_layernorm.weight"}


def test_embedding_and_lm_head_frozen_shared_and_not_saved(target, tmp_path):
    d = make_drafter(target)
    assert d.embed_tokens is target.model.embed_tokens and d.lm_head is target.lm_head
    names = {n for n, _ in d.named_parameters()}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in EXPORT_LAYER_NAMES}
    assert names == expected
    sd = d.trainable_state_dict()
    assert set(sd) == expected and set(d.state_dict()) == expected
    n_params = sum(p.numel() for p in d.parameters())
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == n_params
    shared = {id(target.model.embed_tokens.weight), id(target.lm_head.weight)}
    assert not shared & {id(p) for g in opt.param_groups for p in g["params"]}
    # gradients reach the drafter through the lm_head, never the frozen weights
    inputs, _ = make_row(target, 4)
    emb_before, head_before = target.model.embed_tokens.weight.clone(), target.lm_head.weight.clone()
    d.logits(d(**inputs)).logsumexp(-1).mean().backward()
    opt.step()
    assert target.model.embed_tokens.weight.grad is None and target.lm_head.weight.grad is None
    assert torch.equal(target.model.embed_tokens.weight, emb_before) and torch.equal(target.lm_head.weight, head_before)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())
    # .to() moves the drafter's own weights only
    d64 = make_drafter(target).to(torch.float64)
    assert d64.fc.weight.dtype == torch.float64 and target.lm_head.weight.dtype == torch.float32
    # safetensors round trip of the trainable weights reproduces the outputs
    from safetensors.torch import save_file, load_file
    save_file(d.trainable_state_dict(), str(tmp_path / "drafter.safetensors"))
    d2 = make_drafter(target, seed=123).load_trainable_state_dict(load_file(str(tmp_path / "drafter.safetensors")))
    torch.testing.assert_close(d2(**inputs), d(**inputs))
    with pytest.raises(KeyError, match="missing"):
        d2.load_trainable_state_dict({k: v for k, v in sd.items() if k != "norm.weight"})
    with pytest.raises(KeyError, match="unexpected"):
        d2.load_trainable_state_dict({**sd, "embed_tokens.weight": target.model.embed_tokens.weight})


def test_init_is_seeded_and_trainable_parts_start_sane(target):
    a, b = make_drafter(target, seed=3), make_drafter(target, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(a.norm.weight, torch.ones(64))
    assert abs(a.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.005


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_cuda_backends_match_sdpa_forward_and_grads(target, backend):
    tgt = tiny_target("qwen3", dtype=torch.bfloat16).cuda()
    d = make_drafter(tgt, head_dim=64, num_attention_heads=4, num_key_value_heads=2).cuda()
    inputs, _ = make_row(tgt, 4)
    inputs = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in inputs.items()}
    inputs["layout"] = AnchorBlockLayout(*(t.cuda() for t in (inputs["layout"].anchors, inputs["layout"].keep,
                                                               inputs["layout"].doc_ids)), 4)
    outs = {}
    for be in ("sdpa", backend):
        d.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = d(**inputs, backend=be)
        h.float().square().mean().backward()
        outs[be] = (h.float(), {n: p.grad.float().clone() for n, p in d.named_parameters()})
    torch.testing.assert_close(outs[backend][0], outs["sdpa"][0], rtol=5e-2, atol=5e-2)
    for n, g in outs["sdpa"][1].items():
        assert (outs[backend][1][n] - g).norm() <= 0.05 * g.norm() + 1e-6, n
