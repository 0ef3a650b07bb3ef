"""Target feature capture (dflash_nb.target) on tiny Qwen3, Qwen3.5-hybrid and Llama models built from configs."""
import importlib.util
from pathlib import Path
import pytest, torch
from torch import nn
import dflash_nb.target as target_mod
from dflash_nb.target import (default_target_layer_ids, find_decoder_layers, tiny_target, load_target, TargetFeatures,
                              document_spans, bucket_spans, block_causal_mask, packed_support, fast_paths,
                              fast_paths_line)

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


# the padded path at three bucket sizes for every arch; the packed path ("auto" packs them all; max_batch_tokens unused)
CASES = [(a, mbt, "padded") for a in ARCHS for mbt in (1, 80, 100_000)] + [(a, 1, "auto") for a in ARCHS]


@pytest.mark.parametrize("arch,max_batch_tokens,packing", CASES)
def test_packed_row_equals_documents_alone(models, arch, max_batch_tokens, packing):
    # 70 > the DeltaNet chunk (64): the hybrid's chunked recurrence runs over more than one chunk with padding
    lengths = [5, 70, 1, 17, 33, 2]
    docs, ids, doc_ids = packed_row(lengths, pad=6, seed=2)
    tf = TargetFeatures(models[arch], [0, 2, 4], max_batch_tokens=max_batch_tokens, packing=packing)
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
        tf = TargetFeatures(m, [2, 1], max_batch_tokens=16, packing="padded")   # micro-batches [8, 4], [3]
        tf(ids, doc_ids)
        assert calls == {"layer0": 2, "layer1": 2, "layer2": 2}
        calls.clear()
        tf = TargetFeatures(m, [2, 1], max_batch_tokens=16)
        tf(ids, doc_ids)   # packed where supported: one forward for the whole row
        n = 1 if tf.packing == "packed" else 2
        assert calls == {"layer0": n, "layer1": n, "layer2": n}
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


# ---- packed rows: one forward per row, documents isolated by positions + a block-diagonal mask (or varlen kernels)

def per_document(model, ids, doc_ids, layer_ids, final_hidden=False):
    "The naive reference: every document of the row run alone (padded path, one document per forward)."
    tf = TargetFeatures(model, layer_ids, final_hidden=final_hidden, packing="padded", max_batch_tokens=1)
    return tf(ids, doc_ids)


def test_block_causal_mask():
    m = block_causal_mask([2, 1, 3], torch.float32)
    assert m.shape == (1, 1, 6, 6) and m.dtype == torch.float32
    keep = (m[0, 0] == 0).int()
    assert keep.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert m[0, 0, 0, 1] == torch.finfo(torch.float32).min
    assert block_causal_mask([4], torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("final_hidden", [False, True])
def test_packed_equals_per_document_dense(arch, attn, final_hidden):
    m = tiny_target(arch, attn_implementation=attn)
    # padding at the end and a padding run between documents; a 1-token document; 70 > one 64-token tile
    _, ids, doc_ids = packed_row([5, 70, 1, 17], pad=6, seed=11)
    doc_ids = torch.cat([doc_ids[:5], torch.full((3,), -1), doc_ids[5:]])
    ids = torch.cat([ids[:5], torch.zeros(3, dtype=torch.long), ids[5:]])
    tf = TargetFeatures(m, [0, 2, 3], final_hidden=final_hidden)
    assert tf.packing == "packed" and attn in tf.packing_reason, tf.packing_reason
    f = tf(ids, doc_ids)
    torch.testing.assert_close(f, per_document(m, ids, doc_ids, [0, 2, 3], final_hidden), rtol=1e-5, atol=1e-5)
    assert torch.equal(f[doc_ids < 0], torch.zeros(9, tf.output_size))


def test_packed_isolation_can_fail(monkeypatch):
    "Fault injection: a causal mask over the whole row (positions still restarting): document 2 sees document 1."
    m = tiny_target("qwen3", attn_implementation="eager")
    _, ids, doc_ids = packed_row([9, 12], seed=12)
    good = TargetFeatures(m, [1, 2])(ids, doc_ids)
    real = target_mod.block_causal_mask
    one_block = lambda lengths, dtype, device=None: real([sum(lengths)], dtype, device)
    monkeypatch.setattr(target_mod, "block_causal_mask", one_block)
    leaky = TargetFeatures(m, [1, 2])(ids, doc_ids)
    torch.testing.assert_close(leaky[:9], good[:9], rtol=1e-5, atol=1e-5)
    assert (leaky[9:] - good[9:]).abs().max() > 1e-2


def test_per_document_sdpa_isolation_can_fail(models, monkeypatch):
    "Fault injection: the sdpa path's attention ignores the document bounds (one causal sequence): document 2 leaks."
    from transformers import AttentionInterface
    m = models["qwen3"]
    _, ids, doc_ids = packed_row([9, 12], seed=12)
    good = TargetFeatures(m, [1, 2])(ids, doc_ids)
    calls = []
    def leaky(*args, document_bounds=None, **kwargs):
        calls.append(document_bounds)
        return target_mod.per_document_sdpa(*args, document_bounds=None, **kwargs)
    real_register = AttentionInterface.register
    monkeypatch.setattr(AttentionInterface, "register", classmethod(lambda cls, name, fn: real_register(name, leaky)))
    bad = TargetFeatures(m, [1, 2])(ids, doc_ids)
    monkeypatch.undo()
    assert calls and calls[0] == [(0, 9), (9, 21)]
    torch.testing.assert_close(bad[:9], good[:9], rtol=1e-5, atol=1e-5)
    assert (bad[9:] - good[9:]).abs().max() > 1e-2
    torch.testing.assert_close(TargetFeatures(m, [1, 2])(ids, doc_ids), good)   # the real one registered again


def test_hybrid_on_cpu_packs_with_the_torch_path_and_says_so(models, monkeypatch):
    m = models["qwen3_5"]
    ok, why = packed_support(m)
    assert ok and "conv torch reference once per document, recurrence torch reference once per document" in why
    tf = TargetFeatures(m, [1, 2])
    assert tf.packing == "packed" and tf.packing_reason == why
    assert TargetFeatures(m, [1, 2], packing="packed").packing == "packed"
    with monkeypatch.context() as mp:
        mp.setattr(m, "_use_kernels", True, raising=False)
        with pytest.raises(ValueError, match="packing='packed' is not possible.*hub kernels"):
            TargetFeatures(m, [1, 2], packing="packed")
    with pytest.raises(ValueError, match="packing must be"):
        TargetFeatures(m, [1, 2], packing="both")
    assert TargetFeatures(models["qwen3"], [1], packing="padded").packing_reason == "packing='padded' was asked for"


def test_packing_support_by_model_and_attention():
    assert packed_support(tiny_target("qwen3", attn_implementation="eager"))[0]
    ok, why = packed_support(tiny_target("qwen3", attn_implementation="flex_attention"))
    assert not ok and "flex_attention" in why


def test_fast_paths_report_and_line(models):
    r = fast_paths(models["qwen3"])
    assert r == dict(model_type="qwen3", device="cpu", attn_implementation="sdpa", linear_attention_layers=0,
                     linear_attention_kernel=None, causal_conv1d=None, packed=True, packed_reason=r["packed_reason"])
    assert "rows packed" in fast_paths_line(r) and "linear attention" not in fast_paths_line(r)
    h = fast_paths(models["qwen3_5"])
    assert (h["linear_attention_layers"], h["linear_attention_kernel"], h["causal_conv1d"], h["packed"]) == \
        (4, "torch reference", "torch reference", True)
    assert "linear attention 4 layers: recurrence torch reference / conv torch reference; rows packed" in \
        fast_paths_line(h)


def test_fast_paths_warns_on_cuda_reference_path(models, monkeypatch):
    "Fault injection: the target claims to sit on CUDA; the hybrid on the torch reference warns with the install line."
    import warnings
    monkeypatch.setattr(target_mod, "_device_type", lambda model: "cuda")
    with pytest.warns(UserWarning, match=r"WARNING.*torch reference.*pip install 'dflash_nb\[gpu\]'.*wheels only"):
        r = fast_paths(models["qwen3_5"])
    assert r["packed"] and "torch reference once per document" in r["packed_reason"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast_paths(models["qwen3"])                       # a dense target on CUDA has nothing to warn about
        bound = lambda mod, name: {"causal_conv1d_fn": "causal_conv1d"}.get(name, "fla")
        monkeypatch.setattr(target_mod, "_bound_kernel", bound)
        r = fast_paths(models["qwen3_5"])                 # both kernels bound: no warning, packed
        assert (r["linear_attention_kernel"], r["causal_conv1d"], r["packed"]) == ("fla", "causal_conv1d", True)
        assert "conv causal-conv1d (seq_idx), recurrence fla varlen (cu_seqlens)" in r["packed_reason"]
        monkeypatch.setattr(target_mod, "_bound_kernel", lambda mod, name: "fla" if "delta" in name else None)
        monkeypatch.setattr(target_mod, "_fla_installed", lambda: True)
        r = fast_paths(models["qwen3_5"])                 # fla alone (no causal-conv1d): fla's own conv, packed
    assert (r["linear_attention_kernel"], r["causal_conv1d"], r["packed"]) == ("fla", "fla", True)
    assert "conv fla varlen (cu_seqlens), recurrence fla varlen (cu_seqlens)" in r["packed_reason"]


def test_fast_paths_reads_what_transformers_bound(models):
    "The kernel report reads the package transformers bound into the modeling module at import (torch here: no fla)."
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
    assert target_mod.linear_attention_module(models["qwen3_5"]) is mq
    fla = importlib.util.find_spec("fla") is not None
    assert target_mod._bound_kernel(mq, "torch_chunk_gated_delta_rule") == ("fla" if fla else None)
    assert target_mod._bound_kernel(mq, "no_such_function") is None


PROBE = """
import sys, torch
from transformers import AutoModelForCausalLM
from dflash_nb.target import load_target
def status(key): return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))
path, how = sys.argv[1], sys.argv[2]
load_target(path, device="meta")                 # warm up (imports, modeling code) without reading a weight
open("/proc/self/clear_refs", "w").write("5")    # reset the peak resident size (VmHWM) to the current one
base = status("VmRSS")
if how == "host_then_move": m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("meta")
else: m = load_target(path, dtype=torch.bfloat16, device="meta")
assert next(m.parameters()).device.type == "meta" and not m.training
print((status("VmHWM") - base) / 1024)
"""


@pytest.mark.slow
def test_load_target_puts_weights_straight_on_the_device(tmp_path):
    "Peak host memory of a bf16 load onto a non-host device (meta stands in for a GPU): the old way holds the model."
    # two fresh interpreters importing transformers: ~15 s on two quiet cores
    import subprocess, sys
    big = tiny_target("qwen3", hidden_size=512, num_layers=4, intermediate_size=1536, num_heads=8, num_kv_heads=4,
                      head_dim=64, vocab_size=32000, pad_token_id=0, eos_token_id=1)
    weights_mib = sum(p.numel() for p in big.parameters()) * 4 / 2**20     # ~173 MiB fp32 on disk
    big.save_pretrained(tmp_path)
    def peak(how):
        p = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), how], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        return float(p.stdout.split()[-1])
    old, new = peak("host_then_move"), peak("load_target")
    assert old > 0.5 * weights_mib, (old, weights_mib)        # the test can fail: the old way reads it all into host
    assert new < 0.1 * weights_mib, (new, weights_mib)


def test_load_target_without_accelerate_warns_and_still_loads(tmp_path, models, monkeypatch):
    "Fault injection: an install without accelerate falls back to build-then-move, and says so."
    models["qwen3"].save_pretrained(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.warns(UserWarning, match="accelerate is not installed"):
        m = load_target(tmp_path, device="cpu")
    assert torch.equal(m.lm_head.weight, models["qwen3"].lm_head.weight)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_cuda_packed_equals_per_document(arch):
    "On CUDA (fla's kernels where installed, else the torch path) packed features match per-document runs."
    m = tiny_target(arch, dtype=torch.bfloat16).cuda()
    _, ids, doc_ids = packed_row([40, 7, 130, 1], pad=3, seed=13)
    tf = TargetFeatures(m, [1, 2, 4], packing="packed")
    f = tf(ids.cuda(), doc_ids.cuda())
    ref = per_document(m, ids.cuda(), doc_ids.cuda(), [1, 2, 4])
    torch.testing.assert_close(f.float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_build_run_reports_fast_paths(tmp_path, capsys):
    "The trainer prints the target's fast-path report in one line and writes it to the run dir."
    import json, sys
    sys.path.insert(0, str(Path(__file__).parent))
    from _trainer_common import make_data, train_cfg
    from dflash_nb.trainer import build_run
    cfg = train_cfg(tmp_path / "run", make_data(tmp_path / "data", n=4), steps=1)
    locks = []
    try:
        run = build_run(cfg, locks=locks)
    finally:
        for lock in locks: lock.release()
    report = json.loads((tmp_path / "run" / "target_fast_paths.json").read_text())
    assert report == fast_paths(run.target) and report["packed"] and run.features.packing == "packed"
    assert fast_paths_line(report) in capsys.readouterr().out
