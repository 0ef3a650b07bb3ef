"""Attention backends: sdpa/flex/triton against a plain-torch dense reference, the shared layout, the auto probe."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dflash_nb.attention as A
from dflash_nb.attention import AnchorBlockLayout, anchor_block_attention, reference_anchor_attention, select_backend
from dflash_nb.masks import dense_anchor_block_mask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SM120_ERROR = ("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_backward_0 "
               "Required: 147456 Hardware limit: 101376. Reducing block sizes or `num_stages` may help.")


def _row(g, S=90, B=4, N=9):
    "Multi-document row: a 2-token document, a padding tail, anchors at document starts, padded anchors."
    doc = torch.tensor([0] * 2 + [1] * 30 + [2] * 25 + [3] * (S - 62) + [-1] * 5)
    starts = [0, 2, 32, 57]
    rest = [p for p in torch.randperm(S - 5, generator=g).tolist() if p not in starts][:N - 4]
    anchors = torch.tensor(sorted(starts + rest))
    keep = torch.rand(N, generator=g) > 0.3
    keep[:3] = True
    return anchors, keep, doc


def _qkv(g, H, Hkv, NB, KV, D, dtype=torch.float32, device="cpu"):
    q = torch.randn(1, H, NB, D, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, Hkv, KV, D, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(1, Hkv, KV, D, generator=g).to(device, dtype).requires_grad_()
    return q, k, v


def _plain_reference(q, k, v, mask, scale):
    "softmax(QK^T * scale + mask) V written out, independent of reference_anchor_attention."
    rep = q.shape[1] // k.shape[1]
    k = torch.cat([k[:, i // rep:i // rep + 1] for i in range(q.shape[1])], 1).double()
    v = torch.cat([v[:, i // rep:i // rep + 1] for i in range(q.shape[1])], 1).double()
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale + torch.where(mask, 0.0, float("-inf")).double()
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window,causal", [(None, False), (9, True), (9, False), (None, True)])
def test_sdpa_matches_plain_torch_forward_and_gradients(H, Hkv, window, causal):
    g = torch.Generator().manual_seed(H * 7 + Hkv + (window or 0))
    B, D = 4, 16
    anchors, keep, doc = _row(g, B=B)
    layout = AnchorBlockLayout(anchors, keep, doc, B)
    q, k, v = _qkv(g, H, Hkv, layout.num_queries, layout.kv_len, D)
    out = anchor_block_attention(q, k, v, anchors, keep, doc, B, window=window, causal_in_block=causal, backend="sdpa")
    mask = dense_anchor_block_mask(anchors, keep, doc, B, window, causal)
    ref = _plain_reference(q, k, v, mask, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go.double())
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference_anchor_attention(q, k, v, mask).double(), ref, rtol=1e-5, atol=1e-5)


def test_custom_scale_and_all_padded():
    g = torch.Generator().manual_seed(0)
    anchors, keep, doc = _row(g)
    layout = AnchorBlockLayout(anchors, torch.zeros_like(keep), doc, 4)      # every block padded: own block only
    q, k, v = _qkv(g, 2, 2, layout.num_queries, layout.kv_len, 8)
    out = anchor_block_attention(q, k, v, backend="sdpa", layout=layout, scale=0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _plain_reference(q, k, v, layout.dense_mask(), 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,causal", [(None, False), (9, True)])
def test_flex_forward_matches_reference_on_cpu_and_refuses_training(window, causal):
    g = torch.Generator().manual_seed(3)
    anchors, keep, doc = _row(g)
    layout = AnchorBlockLayout(anchors, keep, doc, 4)
    q, k, v = _qkv(g, 4, 2, layout.num_queries, layout.kv_len, 16)
    with torch.no_grad():
        out = anchor_block_attention(q, k, v, window=window, causal_in_block=causal, backend="flex", layout=layout)
    ref = _plain_reference(q, k, v, layout.dense_mask(window, causal), 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="no flex_attention backward on CPU"):
        anchor_block_attention(q, k, v, window=window, causal_in_block=causal, backend="flex", layout=layout)


def test_layout_builds_each_kind_once():
    "Five layers (four sliding, one full) share one mask build per kind and backend."
    g = torch.Generator().manual_seed(4)
    anchors, keep, doc = _row(g)
    layout = AnchorBlockLayout(anchors, keep, doc, 4)
    q, k, v = _qkv(g, 2, 1, layout.num_queries, layout.kv_len, 8)
    kinds = [(16, True)] * 4 + [(None, False)]
    for _ in range(2):                                   # e.g. two micro-steps reusing the step's layout
        for w, c in kinds:
            anchor_block_attention(q, k, v, window=w, causal_in_block=c, backend="sdpa", layout=layout)
            with torch.no_grad():
                anchor_block_attention(q, k, v, window=w, causal_in_block=c, backend="flex", layout=layout)
    assert layout.builds == {("dense", 16, True): 1, ("dense", None, False): 1, ("ranges", 16, None): 1,
                             ("ranges", None, None): 1, ("block_mask", 16, True): 1, ("block_mask", None, False): 1}
    from dflash_nb.masks import anchor_block_block_mask, block_masks_equal
    assert block_masks_equal(layout.block_mask(16, True), anchor_block_block_mask(anchors, keep, doc, 4, 16, True, method="mask_mod"))
    assert layout.context_ranges(16) is layout.context_ranges(16)


def test_bad_arguments():
    g = torch.Generator().manual_seed(5)
    anchors, keep, doc = _row(g)
    layout = AnchorBlockLayout(anchors, keep, doc, 4)
    q, k, v = _qkv(g, 4, 2, layout.num_queries, layout.kv_len, 8)
    with pytest.raises(ValueError, match="unknown attention backend"):
        anchor_block_attention(q, k, v, backend="cuda-magic", layout=layout)
    with pytest.raises(ValueError, match="layout expects"):
        anchor_block_attention(q, k[:, :, 1:], v[:, :, 1:], backend="sdpa", layout=layout)
    with pytest.raises(ValueError, match="not a multiple"):
        anchor_block_attention(q[:, :3], k, v, backend="sdpa", layout=layout)
    with pytest.raises(ValueError, match="give either layout"):
        anchor_block_attention(q, k, v, backend="sdpa")


def test_auto_on_cpu_ends_at_sdpa_and_records_why(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name, reason = select_backend("cpu", torch.float32, 4, 2, 16, 80, 6, 4, kinds=((None, False), (12, True)), run_dir=tmp_path)
    assert name == "sdpa"
    assert "flex failed (NotImplementedError" in reason and "no flex_attention backward on CPU" in reason
    assert "triton failed" in reason and "needs a CUDA device" in reason
    rec = json.loads((tmp_path / "attention_backend.json").read_text())
    assert rec["backend"] == "sdpa" and rec["reason"] == reason and rec["device"] == "cpu" and rec["dtype"] == "float32"
    assert [(t["backend"], t["ok"]) for t in rec["tried"]] == [("flex", False), ("triton", False), ("sdpa", True)]
    assert rec["shapes"] == dict(num_heads=4, num_kv_heads=2, head_dim=16, seq_len=80, num_anchors=6, block_size=4)
    assert reason.endswith("the only backend that passed (not timed)") and rec["ms_per_step"] == {}
    assert "attention backend: sdpa" in capsys.readouterr().out


def _napping(fn, seconds):
    def slow(*a):
        time.sleep(seconds)
        return fn(*a)
    return slow


@pytest.mark.parametrize("slow,want", [("flex", "sdpa"), ("sdpa", "flex")])
def test_auto_takes_the_fastest_by_measured_time(slow, want, tmp_path, monkeypatch):
    "Fault injection: a correct CPU stand-in for flex (dense-mask SDPA) and a pause in one backend decide the choice."
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sdpa = A._sdpa
    monkeypatch.setattr(A.AnchorBlockLayout, "block_mask", A.AnchorBlockLayout.dense_mask)   # what the stand-in gets
    monkeypatch.setattr(A, "_flex", _napping(sdpa, 0.02) if slow == "flex" else sdpa)
    monkeypatch.setattr(A, "_sdpa", _napping(sdpa, 0.02) if slow == "sdpa" else sdpa)
    layers = [(12, True)] * 4 + [(None, False)]                # the drafter's list: 4 sliding + 1 full layer
    name, reason = select_backend("cpu", torch.float32, 4, 2, 16, 80, 6, 4, kinds=layers, run_dir=tmp_path,
                                  verbose=False, timing_steps=2)
    assert name == want, reason
    rec = json.loads((tmp_path / "attention_backend.json").read_text())
    ms = rec["ms_per_step"]
    assert set(ms) == {"flex", "sdpa"} and ms[slow] >= 5 * 20 and ms[want] < ms[slow]   # 5 layers, each paused 20 ms
    assert f"fastest of 2 timed: {want} " in reason and "per step of 5 layer(s)" in reason and "triton failed" in reason
    assert rec["kinds"] == [[12, True]] * 4 + [[None, False]] and rec["backend"] == want
    assert {t["backend"]: t.get("ms_per_step") for t in rec["tried"]} == {"flex": ms["flex"], "triton": None,
                                                                          "sdpa": ms["sdpa"]}


def test_auto_drops_a_backend_that_fails_when_timed(monkeypatch):
    "A backend that passes the probe once but fails later (memory, say) is recorded and not chosen."
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sdpa, calls = A._sdpa, []
    def flaky(*a):
        calls.append(1)
        if len(calls) > 1: raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return sdpa(*a)
    monkeypatch.setattr(A.AnchorBlockLayout, "block_mask", A.AnchorBlockLayout.dense_mask)
    monkeypatch.setattr(A, "_flex", flaky)
    name, reason = select_backend("cpu", torch.float32, 2, 1, 8, 40, 4, 4, verbose=False)
    assert name == "sdpa" and "fastest of 1 timed: sdpa" in reason, reason


def test_auto_falls_back_past_a_wrong_or_broken_triton(tmp_path, monkeypatch):
    "Flex hits the SM120 limit; a triton that returns wrong numbers is caught by the parity check; sdpa remains."
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    def sm120(*a, **kw): raise RuntimeError(SM120_ERROR)
    def wrong_triton(q, k, v, cs, ce, B, causal, scale, window): return q * 0.5 + 0 * (k.sum() + v.sum())
    monkeypatch.setattr(A, "_flex", sm120)
    monkeypatch.setattr(A, "_triton", wrong_triton)
    name, reason = select_backend("cpu", torch.float32, 2, 1, 8, 40, 4, 4, run_dir=tmp_path, verbose=False)
    assert name == "sdpa", reason
    assert "Hardware limit: 101376" in reason and "triton failed (AssertionError: triton disagrees with the dense reference" in reason
    def broken_triton(*a, **kw): raise ImportError("No module named 'triton'")
    monkeypatch.setattr(A, "_triton", broken_triton)
    name, reason = select_backend("cpu", torch.float32, 2, 1, 8, 40, 4, 4, verbose=False)
    assert name == "sdpa" and "No module named 'triton'" in reason


def test_auto_resolves_once_per_configuration(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(A, "auto_backend_choices", {})
    calls = []
    real = A.select_backend
    monkeypatch.setattr(A, "select_backend", lambda *a, **kw: calls.append(a) or real(*a, **{**kw, "verbose": False}))
    g = torch.Generator().manual_seed(6)
    anchors, keep, doc = _row(g)
    layout = AnchorBlockLayout(anchors, keep, doc, 4)
    q, k, v = _qkv(g, 4, 2, layout.num_queries, layout.kv_len, 8)
    for _ in range(3):
        out = anchor_block_attention(q, k, v, backend="auto", layout=layout)
    assert len(calls) == 1 and list(A.auto_backend_choices.values())[0][0] == "sdpa"
    torch.testing.assert_close(out.double(), _plain_reference(q, k, v, layout.dense_mask(), 8 ** -0.5), rtol=1e-5, atol=1e-5)


_SM120_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    import dflash_nb.attention as A
    from dflash_nb.masks import dense_anchor_block_mask
    ERR = sys.argv[2]
    def sm120(*a, **kw): raise RuntimeError(ERR)
    A._flex = sm120                                       # fault injection: flex fails as on SM120
    A.BACKENDS = ("flex", "triton")                       # sdpa would win the timing against the CPU interpreter
    name, reason = A.select_backend("cpu", torch.float32, 4, 2, 16, 48, 5, 4, kinds=((None, False), (8, True)), run_dir=sys.argv[1])
    # backend="auto" through the public call: triton, equal to the dense reference in output and dq
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([0] * 3 + [1] * 30 + [2] * 10 + [-1] * 5)
    anchors, keep = torch.tensor([0, 3, 4, 20, 40, 0]), torch.tensor([True] * 5 + [False])
    q = torch.randn(1, 4, 24, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 48 + 24, 16, generator=g, requires_grad=True) for _ in range(2))
    out = A.anchor_block_attention(q, k, v, anchors, keep, doc, 4, window=8, causal_in_block=True, backend="auto")
    ref = A.reference_anchor_attention(q, k, v, dense_anchor_block_mask(anchors, keep, doc, 4, 8, True))
    gq = torch.autograd.grad(out.square().sum(), q)[0]; rq = torch.autograd.grad(ref.square().sum(), q)[0]
    print(json.dumps(dict(name=name, reason=reason, auto=[c[0] for c in A.auto_backend_choices.values()],
                          err=(out - ref).abs().max().item(), gerr=(gq - rq).abs().max().item())))
''')


def test_auto_picks_triton_when_flex_hits_the_sm120_limit(tmp_path):
    "Fresh process with TRITON_INTERPRET=1 (the kernel runs in Triton's interpreter on CPU)."
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _SM120_SCRIPT, str(tmp_path), SM120_ERROR], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["name"] == "triton" and out["auto"] == ["triton"]
    assert out["reason"].startswith("flex failed (RuntimeError: No valid triton configs") and "Hardware limit: 101376" in out["reason"]
    assert "triton forward+backward ok, matches the dense reference on 2 kind(s)" in out["reason"]
    assert out["reason"].endswith("the only backend that passed (not timed)")
    assert any(l.startswith("attention backend: triton (flex failed") for l in lines)
    assert out["err"] < 1e-4 and out["gerr"] < 1e-4
    rec = json.loads((tmp_path / "attention_backend.json").read_text())
    assert rec["backend"] == "triton" and [t["ok"] for t in rec["tried"]] == [False, True]
    assert "Hardware limit: 101376" in rec["tried"][0]["error"]


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "triton"])
@pytest.mark.parametrize("window,causal", [(None, False), (256, True)])
def test_gpu_backends_match_reference_bf16(backend, window, causal):
    g = torch.Generator().manual_seed(0)
    S, N, B, H, Hkv, D = 2048, 64, 16, 8, 2, 128
    doc = (torch.arange(S) // 700).cuda()
    anchors = torch.randperm(S - 1, generator=g)[:N].sort().values.cuda()
    keep = (torch.rand(N, generator=g) > 0.1).cuda()
    layout = AnchorBlockLayout(anchors, keep, doc, B)
    q, k, v = _qkv(g, H, Hkv, N * B, S + N * B, D, torch.bfloat16, "cuda")
    out = anchor_block_attention(q, k, v, window=window, causal_in_block=causal, backend=backend, layout=layout)
    ref = reference_anchor_attention(q, k, v, layout.dense_mask(window, causal))
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_gpu_auto_probe_records_choice(tmp_path):
    name, reason = select_backend("cuda", torch.bfloat16, 32, 8, 128, 8192, 512, 16,
                                  kinds=((None, False), (2048, True)), run_dir=tmp_path)
    rec = json.loads((tmp_path / "attention_backend.json").read_text())
    assert name in ("flex", "triton") and rec["backend"] == name and rec["reason"] == reason
