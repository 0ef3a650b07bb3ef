"""Packed rows on Qwen3.5/3.6 hybrid targets (Gated DeltaNet + full attention): one forward per row equals every document
run alone, on CPU (the torch conv and recurrence once per document); fault injections show the comparison catches a
conv or a recurrence that leaks across documents; the fla conv glue, the binding's restore and its refusals."""
import inspect, sys, types
import pytest, torch
import torch.nn.functional as F
import dflash_nb.target as target_mod
from dflash_nb.target import TargetFeatures, document_spans, packed_support, tiny_target, isolated_linear_attention
from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

# a 1-, 2- and 3-token document (shorter than the conv kernel, 4), one longer than the torch recurrence's chunk (64)
LENGTHS, PAD, LAYERS = [5, 150, 1, 3, 2, 40], 7, [0, 3, 5]   # layer 3 is full attention, 0 and 5 Gated DeltaNet


@pytest.fixture(scope="module")
def qwen36():
    "A tiny hybrid with Qwen3.6's layer pattern: 3 Gated DeltaNet layers, then 1 full attention, twice."
    torch.set_num_threads(1)
    m = tiny_target("qwen3_5", num_layers=8, full_attention_interval=4)
    assert m.config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    return m


def packed_row(lengths, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, 151669, (n,), generator=g) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    return ids, doc_ids


def alone(model, ids, doc_ids, final_hidden=False):
    "The reference: every document in a forward of its own (the padded path, one document per micro-batch)."
    return TargetFeatures(model, LAYERS, final_hidden=final_hidden, packing="padded", max_batch_tokens=1)(ids, doc_ids)


def assert_isolated(f, ref, doc_ids):
    "Packed = per document to fp32 round-off (a leak is O(0.1..10)); zeros at padding."
    torch.testing.assert_close(f, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(f[doc_ids < 0], torch.zeros_like(f[doc_ids < 0]))


def test_torch_recurrence_chunk_is_64():
    "The document of 150 tokens spans three chunks of the torch recurrence: its default chunk is 64."
    assert inspect.signature(inspect.unwrap(mq.torch_chunk_gated_delta_rule)).parameters["chunk_size"].default == 64


@pytest.mark.parametrize("attn,final_hidden", [("sdpa", False), ("sdpa", True), ("eager", False)])
def test_packed_hybrid_equals_per_document(qwen36, attn, final_hidden):
    m = qwen36 if attn == "sdpa" else tiny_target("qwen3_5", num_layers=8, full_attention_interval=4,
                                                  attn_implementation=attn)
    ids, doc_ids = packed_row(LENGTHS, PAD, seed=1)
    ids, doc_ids = torch.cat([ids[:5], torch.zeros(2, dtype=torch.long), ids[5:]]), \
        torch.cat([doc_ids[:5], torch.full((2,), -1), doc_ids[5:]])          # a padding run between documents too
    tf = TargetFeatures(m, LAYERS, final_hidden=final_hidden)
    assert tf.packing == "packed" and "once per document" in tf.packing_reason and attn in tf.packing_reason
    calls = []
    hook = m.model.layers[0].linear_attn.register_forward_pre_hook(
        lambda mod, args, kw: calls.append(tuple(kw["hidden_states"].shape)), with_kwargs=True)
    try:
        f = tf(ids, doc_ids)
    finally:
        hook.remove()
    assert calls == [(1, sum(LENGTHS), 64)]        # one forward over the real tokens only
    assert_isolated(f, alone(m, ids, doc_ids, final_hidden), doc_ids)
    assert mq.causal_conv1d_fn.__name__ == "causal_conv1d_fn"   # transformers' own functions are back after the call


def leaky_conv(conv, hidden_states, weight, bias=None, activation=None, **kwargs):
    "Fault: the whole row as one sequence through the conv (what transformers' torch conv does with a packed row)."
    return conv(hidden_states, weight, bias, activation=activation)


def leaky_rule(rule, query, key, value, g, beta, cu_seqlens=None, **kwargs):
    "Fault: the recurrent state flows from one document into the next."
    return rule(query, key, value, g=g, beta=beta, **kwargs)


@pytest.mark.parametrize("name,fault", [("per_document_causal_conv1d", leaky_conv),
                                        ("per_document_gated_delta_rule", leaky_rule)])
def test_a_leak_fails_the_comparison(qwen36, monkeypatch, name, fault):
    "Fault injection: the conv (or the recurrence) crosses document starts; the first document stays right, the rest not."
    ids, doc_ids = packed_row(LENGTHS, PAD, seed=2)
    ref = alone(qwen36, ids, doc_ids)
    monkeypatch.setattr(target_mod, name, fault)
    f = TargetFeatures(qwen36, LAYERS)(ids, doc_ids)
    with pytest.raises(AssertionError):
        assert_isolated(f, ref, doc_ids)
    torch.testing.assert_close(f[:5], ref[:5], rtol=1e-4, atol=1e-4)
    for s, e in document_spans(doc_ids)[1:]:
        assert (f[s:e] - ref[s:e]).abs().max() > 1e-2, (s, e)


def fake_fla_causal_conv1d(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                           activation=None, backend="triton", cu_seqlens=None, **kwargs):
    "fla's causal_conv1d interface in torch: x (B, T, D), weight (D, W), every cu_seqlens sequence from zero history."
    calls.append((tuple(x.shape), tuple(weight.shape), cu_seqlens.tolist()))
    bounds = cu_seqlens.tolist()
    ys = [F.conv1d(x[:, s:e].transpose(1, 2), weight[:, None], bias, padding=weight.shape[1] - 1,
                   groups=weight.shape[0])[..., : e - s] for s, e in zip(bounds[:-1], bounds[1:])]
    y = torch.cat(ys, -1).transpose(1, 2)
    return (F.silu(y) if activation in ("silu", "swish") else y), None


calls = []


def test_fla_conv_glue(qwen36, monkeypatch):
    "CUDA with fla but no causal-conv1d binds fla's conv: layouts, weight and cu_seqlens as fla takes them (a torch fake)."
    fake = types.ModuleType("fla.modules.causal_conv1d")
    fake.causal_conv1d = fake_fla_causal_conv1d
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", fake)
    monkeypatch.setattr(target_mod, "_device_type", lambda model: "cuda")
    monkeypatch.setattr(target_mod, "_fla_installed", lambda: True)
    ids, doc_ids = packed_row([9, 70, 2], 3, seed=3)
    tf = TargetFeatures(qwen36, LAYERS)
    assert "conv fla varlen (cu_seqlens), recurrence torch reference once per document" in tf.packing_reason
    calls.clear()
    f = tf(ids, doc_ids)
    D = qwen36.model.layers[0].linear_attn.conv_dim
    assert calls == [((1, 81, D), (D, 4), [0, 9, 79, 81])] * 5     # layers 0, 1, 2, 4, 5 (3 is full attention)
    assert_isolated(f, alone(qwen36, ids, doc_ids), doc_ids)


def test_binding_is_restored_when_the_forward_fails(qwen36):
    before = (mq.causal_conv1d_fn, mq.torch_chunk_gated_delta_rule)
    with pytest.raises(RuntimeError, match="boom"), isolated_linear_attention(qwen36) as bound:
        assert bound == {"causal_conv1d_fn": "torch reference", "torch_chunk_gated_delta_rule": "torch reference"}
        assert mq.causal_conv1d_fn is not before[0]
        raise RuntimeError("boom")
    assert (mq.causal_conv1d_fn, mq.torch_chunk_gated_delta_rule) == before


def test_refusals(qwen36, monkeypatch):
    "No cache state with packed rows; a layer that does not call the rebound globals, or hub kernels: padded, and why."
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="without a cache"):
        target_mod.per_document_gated_delta_rule(inspect.unwrap(mq.torch_chunk_gated_delta_rule), q, q, q,
                                                 torch.zeros(1, 4, 2), torch.zeros(1, 4, 2),
                                                 cu_seqlens=torch.tensor([0, 4]), output_final_state=True)
    monkeypatch.setattr(target_mod, "_CONV", "some_other_conv")
    ok, why = packed_support(qwen36)
    assert not ok and "do not call some_other_conv" in why
    assert TargetFeatures(qwen36, LAYERS).packing == "padded"
    monkeypatch.undo()
    monkeypatch.setattr(qwen36, "_use_kernels", True, raising=False)
    assert packed_support(qwen36) == (False, "hub kernels are not verified with packed (varlen) input")


def test_gpu_extra_is_wheels_only():
    "The [gpu] extra names fla's two pure-Python wheels and not causal-conv1d (a source build); the install line agrees."
    import configparser, re
    from pathlib import Path
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "settings.ini")
    names = {re.split(r"[<>=!~;\[ ]", r)[0] for r in cfg["DEFAULT"]["gpu_requirements"].split()}
    assert names == {"flash-linear-attention", "fla-core"}
    assert "dflash_nb[gpu]" in target_mod.GPU_INSTALL and "causal-conv1d" in target_mod.GPU_INSTALL   # optional


@pytest.mark.gpu
def test_cuda_packed_hybrid_equals_per_document():
    "On CUDA in bf16: fla's varlen conv and recurrence where fla is installed (else the torch path), = per document."
    import importlib.util
    m = tiny_target("qwen3_5", num_layers=8, full_attention_interval=4, dtype=torch.bfloat16).cuda()
    ids, doc_ids = packed_row(LENGTHS, PAD, seed=4)
    tf = TargetFeatures(m, LAYERS)
    fla = importlib.util.find_spec("fla") is not None
    assert tf.packing == "packed" and ("recurrence fla varlen" in tf.packing_reason) == fla, tf.packing_reason
    f = tf(ids.cuda(), doc_ids.cuda())
    ref = alone(m, ids.cuda(), doc_ids.cuda())
    torch.testing.assert_close(f.float(), ref.float(), rtol=3e-2, atol=3e-2)
