"""Target feature capture (dflash_nb.target) on tiny Qwen3, Qwen3.5-hybrid and Llama models built from configs."""
import pytest, torch
from torch import nn
from dflash_nb.target import (default_target_layer_ids, find_decoder_layers, tiny_target, load_target, TargetFeatures,
                              document_spans, bucket_spans)

ARCHS = ["qwen3", "qwen3_5", "llama"]


@pytest.fixture(scope="module")
def models():
    return {a: tiny_target(a) for a in ARCHS}


def reference_features(model, ids, layer_ids):
    "The naive capture: full forward with output_hidden_states on one document."
    with torch.no_grad():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], -1)


def packed_row(lengths, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 151669, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    return docs, ids, doc_ids


def test_default_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(64) == [1, 16, 31, 46, 61]
    for L in range(4, 80):
        for n in range(2, 7):
            ids = default_target_layer_ids(L, n)
            assert ids[0] == 1 and ids[-1] == L - 3 and ids == sorted(ids) and len(ids) == n
    assert default_target_layer_ids(36, 1) == [18]
    with pytest.raises(ValueError):
        default_target_layer_ids(36, 0)


def test_find_decoder_layers(models):
    for a, m in models.items():
        assert find_decoder_layers(m) is m.model.layers
    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        find_decoder_layers(nn.Linear(2, 2))


def test_tiny_target_is_deterministic_and_covers_tokenizer(models):
    for a in ARCHS:
        m2 = tiny_target(a)
        for (n1, p1), (n2, p2) in zip(models[a].named_parameters(), m2.named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2)
        assert m2.get_input_embeddings().weight.shape[0] >= 151669
        assert not any(p.requires_grad for p in m2.parameters()) and not m2.training
    assert not torch.equal(tiny_target("qwen3", seed=1).lm_head.weight, models["qwen3"].lm_head.weight)
    s = torch.get_rng_state(); tiny_target("qwen3"); assert torch.equal(s, torch.get_rng_state())  # global RNG untouched
    assert set(models["qwen3_5"].config.layer_types) == {"linear_attention", "full_attention"}
    with pytest.raises(ValueError, match="unknown tiny target arch"):
        tiny_target("gpt2")


@pytest.mark.parametrize("arch", ARCHS)
def test_hook_features_equal_hidden_states(models, arch):
    m = models[arch]
    _, ids, _ = packed_row([23], seed=1)
    L = len(find_decoder_layers(m))
    layer_ids = list(range(L - 1))  # hidden_states[L] is taken after the final norm in transformers
    f = TargetFeatures(m, layer_ids)(ids, torch.zeros(23, dtype=torch.long))
    assert f.shape == (23, len(layer_ids) * 64)
    torch.testing.assert_close(f, reference_features(m, ids, layer_ids), rtol=0, atol=1e-6)
    # order and repetition of the ids are kept
    f2 = TargetFeatures(m, [3, 0, 3])(ids, torch.zeros(23, dtype=torch.long))
    torch.testing.assert_close(f2, reference_features(m, ids, [3, 0, 3]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("max_batch_tokens", [1, 80, 100_000])
def test_packed_row_equals_documents_alone(models, arch, max_batch_tokens):
    # 70 > the DeltaNet chunk (64): the hybrid's chunked recurrence runs over more than one chunk with padding
    lengths = [5, 70, 1, 17, 33, 2]
    docs, ids, doc_ids = packed_row(lengths, pad=6, seed=2)
    tf = TargetFeatures(models[arch], [0, 2, 4], max_batch_tokens=max_batch_tokens)
    f = tf(ids, doc_ids)
    start = 0
    for d in docs:
        alone = reference_features(models[arch], d, [0, 2, 4])
        # fp32 rounding differs between batch shapes (~1e-5); a leak between documents is O(0.1) (next test)
        torch.testing.assert_close(f[start:start + len(d)], alone, rtol=1e-4, atol=1e-4)
        start += len(d)
    assert torch.equal(f[start:], torch.zeros(6, 3 * 64))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_packing_as_one_sequence_would_leak(models, arch):
    "The isolation test can fail: running the packed row as one sequence changes the second document's features."
    docs, ids, doc_ids = packed_row([9, 12], seed=3)
    f = TargetFeatures(models[arch], [1, 2])(ids, doc_ids)
    leaky = reference_features(models[arch], ids, [1, 2])
    assert torch.allclose(leaky[:9], f[:9], atol=1e-4)
    assert (leaky[9:] - f[9:]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_stops_after_last_needed_layer(models, arch):
    m = models[arch]
    calls, handles = {}, []
    def count(name):
        return lambda mod, args: calls.__setitem__(name, calls.get(name, 0) + 1)
    layers = find_decoder_layers(m)
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(count(f"layer{i}")))
    handles.append(m.model.norm.register_forward_pre_hook(count("norm")))
    handles.append(m.lm_head.register_forward_pre_hook(count("lm_head")))
    try:
        docs, ids, doc_ids = packed_row([4, 8, 3], seed=4)
        tf = TargetFeatures(m, [2, 1], max_batch_tokens=16)   # micro-batches [8, 4], [3]
        tf(ids, doc_ids)
        assert calls == {"layer0": 2, "layer1": 2, "layer2": 2}
        # hooks are gone after the call: the model still runs to the logits
        calls.clear()
        with torch.no_grad():
            out = m(input_ids=ids[None])
        assert out.logits.shape == (1, 15, 151936)
        assert calls == {**{f"layer{i}": 1 for i in range(len(layers))}, "norm": 1, "lm_head": 1}
    finally:
        for h in handles: h.remove()


def test_spans_and_buckets():
    assert document_spans(torch.tensor([], dtype=torch.long)) == []
    assert document_spans(torch.tensor([-1, -1])) == []
    assert document_spans(torch.tensor([3, 3, 1, 1, 1, -1, 3])) == [(0, 2), (2, 5), (6, 7)]
    spans = [(0, 5), (5, 75), (75, 76), (76, 93)]
    for mbt in (1, 50, 140, 10_000):
        batches = bucket_spans(spans, mbt)
        assert sorted(s for b in batches for s in b) == sorted(spans)
        for b in batches:
            longest = max(e - s for s, e in b)
            assert len(b) == 1 or longest * len(b) <= mbt


def test_features_are_trainable_inputs_and_shared_modules(models):
    m = models["qwen3"]
    tf = TargetFeatures(m, [1, 3])
    assert (tf.num_features, tf.hidden_size, tf.feature_size, tf.num_target_layers) == (2, 64, 128, 6)
    assert tf.embed_tokens is m.model.embed_tokens and tf.lm_head is m.lm_head
    _, ids, doc_ids = packed_row([6, 4], pad=2, seed=5)
    f = tf(ids, doc_ids)
    assert not f.is_inference() and not f.requires_grad and f.dtype == torch.float32
    fc = nn.Linear(128, 8)
    fc(f).square().sum().backward()
    assert fc.weight.grad is not None and all(p.grad is None for p in m.parameters())
    with pytest.raises(ValueError, match="out of range"):
        TargetFeatures(m, [0, 6])
    # layer L - 1: serving reads hidden_states[L], which is after the final norm; refused with the reason
    with pytest.raises(ValueError, match="last decoder layer.*final norm"):
        TargetFeatures(m, [1, 5])
    from dflash_nb.model import DrafterConfig
    with pytest.raises(ValueError, match="last decoder layer"):
        DrafterConfig.from_target(m.config, target_layer_ids=[1, 5])
    DrafterConfig.from_target(m.config, target_layer_ids=[1, 4])    # L - 2 is fine
    with pytest.raises(ValueError, match="empty"):
        TargetFeatures(m, [])


def test_bf16_target_gives_bf16_features():
    m = tiny_target("qwen3", dtype=torch.bfloat16)
    docs, ids, doc_ids = packed_row([7, 5], seed=6)
    f = TargetFeatures(m, [1, 2])(ids, doc_ids)
    assert f.dtype == torch.bfloat16
    ref = torch.cat([reference_features(m, d, [1, 2]) for d in docs])
    torch.testing.assert_close(f.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_load_target_round_trip(tmp_path, models):
    m = models["qwen3_5"]
    m.save_pretrained(tmp_path)
    m2 = load_target(tmp_path, device="cpu")
    assert not m2.training and not any(p.requires_grad for p in m2.parameters())
    assert next(m2.parameters()).dtype == torch.float32
    _, ids, doc_ids = packed_row([10, 4], seed=7)
    torch.testing.assert_close(TargetFeatures(m2, [1, 2])(ids, doc_ids), TargetFeatures(m, [1, 2])(ids, doc_ids))
    m3 = load_target(tmp_path, dtype="bfloat16", device="cpu")
    assert next(m3.parameters()).dtype == torch.bfloat16


def test_multimodal_qwen3_5_wrapper(tmp_path):
    "Qwen3.5/3.6 checkpoints are multimodal: layers under model.language_model; load_target gives the text CausalLM."
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    text = tiny_target("qwen3_5").config.to_dict()
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                        out_hidden_size=64, patch_size=2, temporal_patch_size=1, spatial_merge_size=1))
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(cfg).eval()
    assert find_decoder_layers(vlm) is vlm.model.language_model.layers
    docs, ids, doc_ids = packed_row([8, 5], seed=8)
    f = TargetFeatures(vlm, [1, 3])(ids, doc_ids)
    torch.testing.assert_close(f[:8], reference_features(vlm, docs[0], [1, 3]), rtol=1e-5, atol=1e-6)
    vlm.save_pretrained(tmp_path)
    m = load_target(tmp_path, device="cpu")
    torch.testing.assert_close(TargetFeatures(m, [1, 3])(ids, doc_ids), f)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_cuda_bf16_capture(arch):
    m = tiny_target(arch, dtype=torch.bfloat16).cuda()
    docs, ids, doc_ids = packed_row([40, 7, 90], pad=3, seed=9)
    tf = TargetFeatures(m, [1, 2, 4])
    f = tf(ids.cuda(), doc_ids.cuda())
    assert f.device.type == "cuda" and f.dtype == torch.bfloat16
    start = 0
    for d in docs:
        torch.testing.assert_close(f[start:start + len(d)].float(),
                                   reference_features(m, d.cuda(), [1, 2, 4]).float(), rtol=3e-2, atol=3e-2)
        start += len(d)
