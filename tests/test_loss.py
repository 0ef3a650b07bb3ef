"""dflash_nb.loss: weights, chunked == naive (values, gradients, counters), frozen lm_head, no NaN, memory bound, τ, options."""
import json, math, os, subprocess, sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck
from torch.utils.flop_counter import FlopCounterMode

from dflash_nb.loss import (BlockLossOutput, block_loss, default_gamma, dpace_weights, expected_acceptance_length,
                            naive_block_loss, slot_accuracy, slot_weights, auto_chunk_blocks)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are tiny: intra-op threads only add overhead, and spin badly on a shared, oversubscribed CPU box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_case(N=6, B=4, H=12, V=40, dtype=torch.float64, p_valid=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N * B, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (N, B), generator=g)
    valid = torch.rand(N, B, generator=g) < p_valid
    return h, W, labels, valid


def loss_and_grads(fn, h, W, labels, valid, **kw):
    h = h.detach().clone().requires_grad_()
    W = W.detach().clone().requires_grad_()
    out = fn(h, W, labels, valid, **kw)
    gh, gW = torch.autograd.grad(out.loss, (h, W))
    return out, gh, gW


# ---------------------------------------------------------------- weights

def test_gamma_and_weights():
    assert [default_gamma(b) for b in (16, 10, 8)] == [7, 5, 4]
    assert [default_gamma(b) for b in (2, 4, 32)] == [1, 2, 14]
    w = slot_weights(16)
    assert w.shape == (16,) and w.dtype == torch.float32
    assert w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[1:], torch.exp(-torch.arange(15.0) / 7))
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        default_gamma(1)
    with pytest.raises(ValueError, match="gamma must be > 0"):
        slot_weights(8, -1.0)


def test_naive_against_explicit_loop():
    """The naive reference itself, against a python loop over blocks and slots (independent code)."""
    h, W, labels, valid = make_case(N=5, B=5, V=30, seed=3)
    gamma = 2.5
    out = naive_block_loss(h, W, labels, valid, gamma)
    num = den = 0.0
    correct = [0] * 5
    count = [0] * 5
    for j in range(5):
        for k in range(1, 5):
            if not valid[j, k]: continue
            z = W @ h[j * 5 + k]
            ce = (torch.logsumexp(z, 0) - z[labels[j, k]]).item()
            w = math.exp(-(k - 1) / gamma)
            num += w * ce; den += w
            count[k] += 1; correct[k] += int(z.argmax().item() == labels[j, k].item())
    assert isinstance(out, BlockLossOutput)
    assert out.loss.item() == pytest.approx(num / den, rel=1e-12)
    assert out.slot_count.tolist() == count and out.slot_correct.tolist() == correct
    assert out.slot_correct.dtype == torch.long and out.slot_count.dtype == torch.long
    assert out.weight_sum.item() == pytest.approx(den, rel=1e-12)


# ---------------------------------------------------------------- chunked == naive

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(N=st.integers(1, 9), B=st.integers(2, 6), V=st.integers(2, 50), chunk=st.integers(1, 12),
       p=st.sampled_from([0.0, 0.3, 1.0]), w_grad=st.booleans(), weighting=st.sampled_from(["decay", "dpace"]),
       seed=st.integers(0, 10**6))
def test_chunked_equals_naive(N, B, V, chunk, p, w_grad, weighting, seed):
    h, W, labels, valid = make_case(N, B, 8, V, p_valid=p, seed=seed)
    ref, gh_ref, gW_ref = loss_and_grads(naive_block_loss, h, W, labels, valid, weighting=weighting)
    out, gh, gW = loss_and_grads(block_loss, h, W, labels, valid, chunk_blocks=chunk, weighting=weighting)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gW, gW_ref, rtol=1e-10, atol=1e-12)
    assert torch.equal(out.slot_correct, ref.slot_correct) and torch.equal(out.slot_count, ref.slot_count)
    torch.testing.assert_close(out.weight_sum, ref.weight_sum)
    assert torch.isfinite(out.loss) and torch.isfinite(gh).all()


def test_gradcheck():
    h, W, labels, valid = make_case(N=3, B=3, H=5, V=11)
    h.requires_grad_(); W.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: block_loss(a, b, labels, valid, chunk_blocks=2).loss, (h, W))
    tl = torch.randn(9, 11, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b: block_loss(a, b, labels, valid, chunk_blocks=2, target_logits=tl, distill_weight=0.4).loss, (h, W))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-3)])
def test_low_precision(dtype, tol):
    h, W, labels, valid = make_case(N=16, B=4, H=32, V=300, dtype=torch.float32)
    h, W = h.to(dtype), W.to(dtype)
    ref, gh_ref, _ = loss_and_grads(naive_block_loss, h, W, labels, valid)
    hc = h.clone().requires_grad_()
    out = block_loss(hc, W, labels, valid, chunk_blocks=3)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and hc.grad.dtype == dtype
    torch.testing.assert_close(out.loss, ref.loss, rtol=tol, atol=tol)
    torch.testing.assert_close(hc.grad.float(), gh_ref.float(), rtol=10 * tol, atol=tol)
    fp32 = naive_block_loss(h.float(), W.float(), labels, valid).loss
    torch.testing.assert_close(out.loss, fp32, rtol=0.02, atol=0.02)


def test_frozen_lm_head_skips_its_gradient():
    h, W, labels, valid = make_case(N=16, B=4, H=32, V=256, dtype=torch.float32)
    _, gh_ref, _ = loss_and_grads(naive_block_loss, h, W, labels, valid)
    hr = h.clone().requires_grad_()
    assert not W.requires_grad
    with FlopCounterMode(display=False) as fc:
        block_loss(hr, W, labels, valid, chunk_blocks=5).loss.backward()
    assert W.grad is None
    torch.testing.assert_close(hr.grad, gh_ref, rtol=1e-5, atol=1e-6)
    gemm = 2 * h.shape[0] * h.shape[1] * W.shape[0]
    assert fc.get_total_flops() == 3 * gemm     # forward, recompute, ∂hidden — no ∂W GEMM


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(N=st.integers(1, 9), B=st.integers(2, 6), V=st.integers(2, 50), chunk=st.integers(1, 12),
       weighting=st.sampled_from(["decay", "dpace"]), seed=st.integers(0, 10**6))
def test_gradient_in_forward_option(N, B, V, chunk, weighting, seed):
    """recompute=False (frozen lm_head): same loss and ∂hidden as the naive loss, one logits GEMM fewer."""
    h, W, labels, valid = make_case(N, B, 8, V, seed=seed)
    _, gh_ref, _ = loss_and_grads(naive_block_loss, h, W, labels, valid, weighting=weighting)
    ref = naive_block_loss(h, W, labels, valid, weighting=weighting)
    hp = h.clone().requires_grad_()
    with FlopCounterMode(display=False) as fc:
        out = block_loss(hp, W, labels, valid, chunk_blocks=chunk, weighting=weighting, recompute=False)
        out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hp.grad, gh_ref, rtol=1e-10, atol=1e-12)
    assert fc.get_total_flops() == 2 * (2 * N * B * 8 * V)


def test_nothing_valid_and_garbage_rows():
    h, W, labels, valid = make_case(dtype=torch.float32)
    hz = h.clone().requires_grad_()
    out = block_loss(hz, W, labels, torch.zeros_like(valid))
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(hz.grad, torch.zeros_like(hz))
    assert out.slot_count.sum() == 0 and out.weight_sum.item() == 0.0
    # inf/NaN hidden states in invalid rows do not reach the loss, nor the gradient of the valid rows
    # (their own rows' gradient is NaN, exactly as with plain autograd through F.cross_entropy)
    bad = h.clone(); bad[~valid.reshape(-1)] = float("inf")
    hb = bad.requires_grad_()
    out_bad = block_loss(hb, W, labels, valid, chunk_blocks=2)
    out_bad.loss.backward()
    hc = h.clone().requires_grad_()
    out_clean = block_loss(hc, W, labels, valid, chunk_blocks=2)
    out_clean.loss.backward()
    torch.testing.assert_close(out_bad.loss, out_clean.loss)
    rows = valid.reshape(-1)
    torch.testing.assert_close(hb.grad[rows], hc.grad[rows])
    # slot 0 never counts, even if valid says so
    all_valid = torch.ones_like(valid)
    assert block_loss(h, W, labels, all_valid).slot_count[0] == 0


def test_shape_errors():
    h, W, labels, valid = make_case()
    with pytest.raises(ValueError, match="hidden must be"):
        block_loss(h[1:], W, labels, valid)
    with pytest.raises(ValueError, match="labels and valid"):
        block_loss(h, W, labels, valid[:, :2])
    with pytest.raises(ValueError, match="bool"):
        block_loss(h, W, labels, valid.int())
    with pytest.raises(ValueError, match="weighting"):
        block_loss(h, W, labels, valid, weighting="linear")


def test_auto_chunk():
    assert auto_chunk_blocks(16, 151936) == 55
    assert auto_chunk_blocks(16, 151936, chunk_bytes=1) == 1


# ---------------------------------------------------------------- memory

def test_autograd_saves_no_logits():
    h, W, labels, valid = make_case(N=16, B=4, H=32, V=256, dtype=torch.float32)
    shapes = []
    def pack(t): shapes.append(tuple(t.shape)); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block_loss(h.requires_grad_(), W, labels, valid, chunk_blocks=2)
    assert not [s for s in shapes if len(s) == 2 and s[-1] == 256 and s != (256, 32)], shapes


def test_bench_peak_ratio(tmp_path):
    """The benchmark script itself, small: fresh process per variant, RSS high-water mark; chunked ≤ 1/4 of naive."""
    out = tmp_path / "loss.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench/loss.py"), "--device", "cpu", "--anchors", "32", "--hidden", "128",
                        "--vocab", "32768", "--chunk-blocks", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["passes_quarter"] and res["peak_ratio_chunked_over_naive"] <= 0.25, res
    # naive keeps ≥ 2 copies of the 64 MiB of fp32 logits; chunked holds a 2-block chunk (4 MiB) plus temporaries
    assert res["results"]["naive"]["peak_bytes"] >= 2 * 512 * 32768 * 4
    assert res["loss_abs_diff"] < 1e-4


@pytest.mark.gpu
def test_gpu_no_sync_and_memory():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, B, H, V = 128, 16, 1024, 151936
    W = (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16()
    labels = torch.randint(0, V, (N, B), device=dev, generator=g)
    valid = torch.rand(N, B, device=dev, generator=g) < 0.8

    def peak(fn, **kw):
        h = torch.randn(N * B, H, device=dev, generator=g).bfloat16().requires_grad_()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        fn(h, W, labels, valid, **kw).loss.backward(); torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    assert peak(block_loss, chunk_blocks=8) * 4 <= peak(naive_block_loss)
    h = torch.randn(N * B, H, device=dev, generator=g).bfloat16().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = block_loss(h, W, labels, valid, chunk_blocks=8)
        out.loss.backward()
        block_loss(h, W, labels, valid, weighting="dpace").loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = naive_block_loss(h.detach().float(), W.float(), labels, valid)
    assert abs(out.loss.item() - ref.loss.item()) < 2e-2
    assert torch.equal(out.slot_count, ref.slot_count)


# ---------------------------------------------------------------- τ

def test_expected_acceptance_length_matches_simulation():
    """Under independent per-slot acceptances, τ equals the mean of 1 + accepted-prefix length of simulated steps."""
    acc = torch.tensor([0.0, 0.95, 0.8, 0.7, 0.6, 0.5, 0.3, 0.2], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    ok = torch.rand(200_000, 7, generator=g, dtype=torch.float64) < acc[1:]
    simulated = (1 + ok.long().cumprod(1).sum(1)).double().mean().item()
    assert expected_acceptance_length(acc) == pytest.approx(simulated, abs=0.02)
    assert expected_acceptance_length(torch.ones(16)) == 16.0
    assert expected_acceptance_length([1.0, 0.0, 1.0]) == 1.0
    with pytest.raises(ValueError):
        expected_acceptance_length([0.0, 1.5])
    torch.testing.assert_close(slot_accuracy(torch.tensor([0, 3]), torch.tensor([0, 4])),
                               torch.tensor([0.0, 0.75], dtype=torch.float64))


# ---------------------------------------------------------------- options

def test_dpace_weights_closed_form():
    ce = torch.tensor([[5.0, 0.2, 1.0, 0.5, 0.1]], dtype=torch.float64)
    valid = torch.ones(1, 5, dtype=torch.bool)
    w = dpace_weights(ce, valid, alpha=0.3)
    q = 0.7 * torch.exp(-ce[0, 1:]) + 0.3
    C = torch.cumprod(q, 0)
    expect = torch.cat([torch.zeros(1, dtype=torch.float64), torch.stack([C[j:].sum() for j in range(4)])])
    torch.testing.assert_close(w[0], expect)
    ce_g = ce.clone().requires_grad_()
    assert not dpace_weights(ce_g, valid).requires_grad              # detached
    # a hole in the mask is skipped, not a chain break; slot after the hole still gets weight
    hole = torch.tensor([[True, True, False, True, True]])
    wh = dpace_weights(ce, hole, alpha=0.3)
    assert wh[0, 2] == 0 and wh[0, 3] > 0 and wh[0, 0] == 0


def test_dpace_training_signal_shifts_to_later_slots():
    """Once early slots are confident, D-PACE gives later slots more weight than before (the point of the method)."""
    valid = torch.ones(1, 6, dtype=torch.bool)
    unsure = dpace_weights(torch.tensor([[0.0, 3.0, 3.0, 3.0, 3.0, 3.0]]), valid)
    sure = dpace_weights(torch.tensor([[0.0, 0.01, 0.01, 3.0, 3.0, 3.0]]), valid)
    assert ((sure[0, 3:] / sure[0, 1]) > (unsure[0, 3:] / unsure[0, 1])).all()


def test_distillation_option():
    h, W, labels, valid = make_case()
    tl = torch.randn(h.shape[0], W.shape[0], dtype=torch.float64)
    for lam in (0.0, 0.5, 1.0):
        ref, gh_ref, gW_ref = loss_and_grads(naive_block_loss, h, W, labels, valid, target_logits=tl, distill_weight=lam)
        out, gh, gW = loss_and_grads(block_loss, h, W, labels, valid, chunk_blocks=4,
                                     target_logits=tl.view(6, 4, -1), distill_weight=lam)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gh, gh_ref); torch.testing.assert_close(gW, gW_ref)
    # recompute=False cannot precompute ∂hidden with a KL term: it falls back to recomputation, same result
    hp = h.clone().requires_grad_()
    block_loss(hp, W, labels, valid, chunk_blocks=4, target_logits=tl, distill_weight=0.5, recompute=False).loss.backward()
    _, gh_ref, _ = loss_and_grads(naive_block_loss, h, W, labels, valid, target_logits=tl, distill_weight=0.5)
    torch.testing.assert_close(hp.grad, gh_ref)
    # KL against an independent formula
    logp = (h @ W.T).log_softmax(-1); logq = tl.log_softmax(-1)
    kl = (logq.exp() * (logq - logp)).sum(-1).view(6, 4)
    w = slot_weights(4).double().expand(6, 4).clone(); w[:, 0] = 0; w = w * valid
    expect = (w * kl).sum() / w.sum()
    torch.testing.assert_close(block_loss(h, W, labels, valid, target_logits=tl, distill_weight=1.0).loss, expect)


# ---------------------------------------------------------------- with the real label builder, and it trains

def test_with_anchor_labels_and_overfit():
    """Labels/valid from anchors.anchor_block_labels; optimising the hidden states drives loss down and accuracy to 1."""
    from dflash_nb.anchors import anchor_block_labels
    g = torch.Generator().manual_seed(0)
    S, B, V, H = 40, 4, 64, 16
    input_ids = torch.randint(0, V, (S,), generator=g)
    doc_ids = torch.tensor([0] * 25 + [1] * 12 + [-1] * 3)
    loss_mask = (torch.arange(S) % 7 != 3) & (doc_ids >= 0)
    anchors = torch.tensor([0, 5, 20, 23, 30, 36])
    keep = torch.tensor([True, True, True, True, True, False])
    labels, valid = anchor_block_labels(input_ids, loss_mask, doc_ids, anchors, keep, B)
    W = torch.randn(V, H, generator=g)
    h = torch.zeros(len(anchors) * B, H, requires_grad=True)
    opt = torch.optim.Adam([h], lr=0.3)
    first = None
    for _ in range(60):
        out = block_loss(h, W, labels, valid, chunk_blocks=2)
        first = first if first is not None else out.loss.item()
        opt.zero_grad(); out.loss.backward(); opt.step()
    assert out.loss.item() < 0.1 * first
    assert torch.equal(out.slot_count, valid.sum(0)) and out.slot_count[0] == 0
    assert torch.equal(out.slot_correct, out.slot_count)     # every valid slot predicted
    acc = slot_accuracy(out.slot_correct, out.slot_count)
    assert expected_acceptance_length(torch.where(out.slot_count > 0, acc, 1.0)) == B
