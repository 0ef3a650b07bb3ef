"""GPU check, step d: target time per row I, the trainer's drafter step T, the pipelined loop P, on one device.

A Qwen3.6-architecture target of reduced depth (hybrid Gated DeltaNet + full attention at hidden 5120, random weights)
and the flagship 5-layer drafter. T and P run the trainer's own `train_step` (with the default `TrainConfig`: its
loss, D-PACE, its optimizer and clipping); I runs `TargetFeatures`. From I at two depths: the per-layer cost and the
64-layer extrapolation; from T at several anchors per row: the anchors that balance a split pair.
"""
from __future__ import annotations

import statistics
import time

from _common import Batches, sync, train_steps, trainer_run, with_features
from gpu_common import device_for, peak_gib, peak_reset
from gpu_flops import FULL_TARGET_RUN_LAYERS
from gpu_models import TARGET_DIMS, hybrid_target, spread_ids
from gpu_plan import need

PIPE = {  # rows, anchors, drafter, target depth, timed rows per phase
    False: dict(max_tokens=4096, anchors=[512, 256, 128], B=16, window=2048, layers=8, doc_len=(600, 3000),
                warmup=2, rows=5),
    True: dict(max_tokens=96, anchors=[8, 4], B=4, window=16, layers=8, doc_len=(20, 60), warmup=1, rows=2),
}


def median_per_item(fn, items, warmup, dev):
    "Seconds per item (median over the items after `warmup` untimed ones), device synchronised; and the outputs."
    out, times = [], []
    for it in items:
        sync(dev)
        t = time.perf_counter()
        out.append(fn(it))
        sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:]), out


class Rows:
    "Random-token documents of random length, packed and anchored by the trainer's own code (`make_batch`)."
    def __init__(self, p, vocab, mask_token_id):
        import torch
        from dflash_nb.rows import RowStream
        g, (lo, hi) = torch.Generator().manual_seed(0), p["doc_len"]
        self.p, self.n, self.mask = p, p["warmup"] + p["rows"], mask_token_id
        n_docs = self.n * max(2, p["max_tokens"] // lo)
        lengths = [int(torch.randint(lo, hi + 1, (1,), generator=g)) for _ in range(n_docs)]
        self.samples = [dict(input_ids=torch.randint(2, vocab - 1, (n,), generator=g).tolist(),
                             loss_mask=[0] * (n // 8) + [1] * (n - n // 8)) for n in lengths]
        self.stream = RowStream(lengths, p["max_tokens"], 0)

    def batch(self, r, anchors):
        from dflash_nb.rows import make_batch
        return make_batch(self.samples, self.stream, r, r, 0, max_tokens=self.p["max_tokens"], block_size=self.p["B"],
                          max_anchors=anchors, mask_token_id=self.mask, seed=0)

    def batches(self, anchors):
        return [self.batch(r, anchors) for r in range(self.n)]


def extrapolate(I_full, n_f, I_half, n_h):
    "Per-layer cost from two depths, the fixed overhead, and I of the 64-layer target (62 layers run), with the sums."
    per_layer = (I_full - I_half) / (n_f - n_h)
    overhead = I_half - n_h * per_layer
    I64 = overhead + FULL_TARGET_RUN_LAYERS * per_layer
    return dict(per_layer_s=per_layer, overhead_s=overhead, I_64_layer_target_s=I64,
                layers_run_for_features=FULL_TARGET_RUN_LAYERS, arithmetic=[
                    f"per layer = (I({n_f}) - I({n_h})) / ({n_f} - {n_h}) = ({I_full:.4f} - {I_half:.4f}) / "
                    f"{n_f - n_h} = {per_layer:.4f} s",
                    f"overhead (embedding, buckets, copies) = I({n_h}) - {n_h} x per layer = {overhead:.4f} s",
                    f"I(64-layer target; the feature forward stops after layer 61, so {FULL_TARGET_RUN_LAYERS} layers "
                    f"run) = {overhead:.4f} + {FULL_TARGET_RUN_LAYERS} x {per_layer:.4f} = {I64:.4f} s per row"])


def balance(T: dict, I64: float) -> dict:
    "T(N) = t0 + t1 N by least squares (proportional from one point) and the N where T(N) = I64."
    Ns = sorted(T)
    if len(Ns) >= 2:
        mN, mT = statistics.fmean(Ns), statistics.fmean(T[n] for n in Ns)
        t1 = sum((n - mN) * (T[n] - mT) for n in Ns) / sum((n - mN) ** 2 for n in Ns)
        t0 = mT - t1 * mN
        fit = f"T(N) = {t0:.4f} + {t1 * 1e3:.4f}e-3 x N s (least squares over N = {Ns})"
    else:
        t0, t1 = 0.0, T[Ns[0]] / Ns[0]
        fit = f"T(N) = {t1 * 1e3:.4f}e-3 x N s (one point, N = {Ns[0]}: proportional, an upper bound on the slope)"
    N_bal = (I64 - t0) / t1 if t1 > 0 else None
    return dict(fit=fit, t0_s=t0, t1_s_per_anchor=t1, anchors_balancing_64_layer_target=N_bal,
                arithmetic=f"T(N) = I64 -> N = ({I64:.4f} - {t0:.4f}) / {t1:.6f} = "
                           + (f"{N_bal:.0f} anchors per row" if N_bal is not None else "undefined"),
                note="a split pair (target on one GPU, drafter on another) runs at max(I64, T(N)) per row; "
                     "it is balanced where T(N) = I64")


def measure_I(a, rec, target, rows, p, dev, max_batch_tokens):
    "Target features per row at full and half depth (the difference is the per-layer cost); the full-depth features."
    from dflash_nb.target import TargetFeatures
    ids_full, ids_half = spread_ids(p["layers"] - 2), spread_ids(p["layers"] // 2 - 2)   # L - 1 is refused
    feats = TargetFeatures(target, ids_full, max_batch_tokens=max_batch_tokens)
    peak_reset(dev)
    I_full, features = median_per_item(lambda r: feats(r.input_ids, r.doc_ids), rows, p["warmup"], dev)
    rec["phases"]["I"] = dict(seconds_per_row=I_full, layers_run=max(ids_full) + 1, layer_ids=ids_full,
                              peak_gib=peak_gib(dev))
    half = TargetFeatures(target, ids_half, max_batch_tokens=max_batch_tokens)
    I_half, _ = median_per_item(lambda r: half(r.input_ids, r.doc_ids), rows, p["warmup"], dev)
    rec["phases"]["I_half"] = dict(seconds_per_row=I_half, layers_run=max(ids_half) + 1, layer_ids=ids_half)
    rec["extrapolation"] = ex = extrapolate(I_full, max(ids_full) + 1, I_half, max(ids_half) + 1)
    print(f"[pipeline] I: {I_full:.4f} s/row ({max(ids_full) + 1} layers), {I_half:.4f} s/row "
          f"({max(ids_half) + 1} layers) -> {ex['I_64_layer_target_s']:.4f} s/row at 64 layers", flush=True)
    rec.save()
    return feats, features


def build_trainer_run(a, rec, cfg, feats, p, dev, dtype):
    "The flagship drafter on this device, its attention backend as the trainer picks it, and the trainer's `Run`."
    import torch
    from dflash_nb.build import build_drafter, pick_backend
    from dflash_nb.model import DrafterConfig
    t0 = time.perf_counter()
    dcfg = DrafterConfig.from_target(feats.model.config, num_hidden_layers=5, layer_types=["sliding"] * 4 + ["full"],
                                     sliding_window=p["window"], block_size=p["B"], target_layer_ids=feats.layer_ids,
                                     mask_token_id=feats.model.config.vocab_size - 1)
    with torch.device(dev):
        drafter = build_drafter(dcfg, feats, dev, 0)
    params = sum(x.numel() for x in drafter.parameters() if x.requires_grad)
    rec["drafter"] = dict(layers=5, layer_types=dcfg.layer_types, sliding_window=dcfg.sliding_window,
                          hidden=dcfg.hidden_size, heads=[dcfg.num_attention_heads, dcfg.num_key_value_heads,
                                                          dcfg.head_dim],
                          params=params, build_s=round(time.perf_counter() - t0, 1), loss=cfg.loss.weighting)
    t0 = time.perf_counter()
    backend, why = (a.backend, "given on the command line") if a.backend != "auto" else \
        pick_backend("auto", dev, dtype, dcfg, p["max_tokens"], p["anchors"][0])
    rec["drafter"].update(backend=backend, backend_reason=why, probe_s=round(time.perf_counter() - t0, 1))
    print(f"[pipeline] drafter {params / 1e9:.2f}B params, attention {backend} ({why[:200]}), loss "
          f"{cfg.loss.weighting}", flush=True)
    return trainer_run(cfg, drafter, dcfg, feats, dev, backend, why), dcfg


def measure_T(a, rec, run, rows, features, p, dev, I64) -> dict:
    "The trainer's step per row on precomputed features, for each anchors-per-row setting that fits."
    rec["phases"]["T"], T = {}, {}
    for i, N in enumerate(p["anchors"]):
        if i and not rec.fits(f"T at {N} anchors", need("pipeline", "T_more", a.dry_run)):
            break
        prepared = Batches(with_features(b, f, dev) for b, f in zip(rows.batches(N), features))
        peak_reset(dev)
        try:
            T[N] = statistics.median(train_steps(run, prepared, p["rows"], p["warmup"]))
        except Exception as e:
            rec.error(f"T at {N} anchors", e)
            break
        rec["phases"]["T"][str(N)] = dict(seconds_per_row=T[N], peak_gib=peak_gib(dev), ratio_T_over_I64=T[N] / I64)
        print(f"[pipeline] T at {N} anchors: {T[N]:.4f} s/row (T/I64 = {T[N] / I64:.2f})", flush=True)
        rec.save()
    return T


def measure_P(rec, run, feats, rows, cfg, p, dev, serial):
    "The trainer's pipelined loop (producer thread + bounded queue, `train_step`), target and drafter on this device."
    import copy
    from dflash_nb.rows import FeatureProducer
    peak_reset(dev)
    # the producer runs ahead by the queue depth and goes on producing past the last consumed row, so the queue is in
    # the same state (full, or empty) at both ends of the timed window: P = window / rows in it
    host = rows.batches(p["anchors"][0])
    make = lambda step, micro: copy.copy(host[step % rows.n])   # noqa: E731  (the producer moves a batch's tensors)
    prod = FeatureProducer(make, feats, 0, rows.n + cfg.queue_depth + 2, 1, dev, dev, depth=cfg.queue_depth,
                           threaded=True)
    try:
        prod.target_clock.take()
        window = train_steps(run, prod, p["rows"], p["warmup"], each=False)[0]
        target_busy = prod.target_clock.take() / rows.n
    finally:
        prod.close()
    P = window / p["rows"]
    rec["phases"]["P"] = dict(seconds_per_row=P, peak_gib=peak_gib(dev), serial_I_plus_T_s=serial,
                              P_over_serial=P / serial, target_busy_s_per_row=target_busy,
                              note="one device: the pipeline cannot beat I + T; P / (I + T) near 1 means the producer "
                                   "thread adds no overhead")
    print(f"[pipeline] P: {P:.4f} s/row vs I + T = {serial:.4f} (ratio {P / serial:.2f})", flush=True)
    rec.save()
    return P


def step_pipeline(a, rec):
    import importlib.util
    import torch
    from dflash_nb.train_config import TrainConfig
    dev, p, dims = device_for(a.dry_run), PIPE[a.dry_run], TARGET_DIMS[a.dry_run]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = TrainConfig(max_tokens=p["max_tokens"], max_anchors=p["anchors"][0], global_batch=1)   # the trainer's default
    fast = {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")}
    rec.update(device=str(dev), dtype=str(dtype)[6:], target=dict(layers=p["layers"], **dims, full_attention_every=4,
                                                                    fast_paths_installed=fast),
               rows=dict(max_tokens=p["max_tokens"], doc_len=p["doc_len"], block_size=p["B"]),
               timing="wall clock per row after warm-up, device synchronised", phases={})
    t0 = time.perf_counter()
    target = hybrid_target(dev, dims, p["layers"], dtype)
    n_target = sum(x.numel() for x in target.parameters())
    rec["target"].update(params=n_target, build_s=round(time.perf_counter() - t0, 1),
                         weights_gib=round(sum(x.numel() * x.element_size() for x in target.parameters()) / 2**30, 2))
    print(f"[pipeline] target: {p['layers']} layers, {n_target / 1e9:.2f}B parameters, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    rows = Rows(p, dims["vocab_size"], dims["vocab_size"] - 1)
    host = rows.batches(p["anchors"][0])
    rec["rows"]["mean_tokens"] = sum(r.n_tokens for r in host) / len(host)
    if not rec.fits("I (target forward)", need("pipeline", "I", a.dry_run)):
        return rec.finish("skipped: no time for the target forward")
    feats, features = measure_I(a, rec, target, host, p, dev, cfg.target.max_batch_tokens)
    I_full, I64 = rec["phases"]["I"]["seconds_per_row"], rec["extrapolation"]["I_64_layer_target_s"]
    n_f = rec["phases"]["I"]["layers_run"]
    if not rec.fits("T (drafter step)", need("pipeline", "T", a.dry_run)):
        return rec.finish(f"I {I_full:.3f} s/row ({n_f} layers), 64-layer estimate {I64:.3f} s; drafter skipped")
    run, _ = build_trainer_run(a, rec, cfg, feats, p, dev, dtype)
    T = measure_T(a, rec, run, rows, features, p, dev, I64)
    N0 = p["anchors"][0]
    if N0 not in T:
        return rec.finish(f"I {I_full:.3f} s/row, 64-layer estimate {I64:.3f} s; drafter step failed")
    rec["balance"] = bal = balance(T, I64)
    rec.save()
    P = None
    if rec.fits("P (pipelined)", need("pipeline", "P", a.dry_run)):
        P = measure_P(rec, run, feats, rows, cfg, p, dev, I_full + T[N0])
    rec["per_row_64_layer"] = dict(one_gpu_serial_s=I64 + T[N0], split_pair_s=max(I64, T[N0]), arithmetic=[
        f"one GPU: I64 + T({N0}) = {I64:.4f} + {T[N0]:.4f} = {I64 + T[N0]:.4f} s per row",
        f"split pair: max(I64, T({N0})) = {max(I64, T[N0]):.4f} s per row "
        f"({'target' if I64 >= T[N0] else 'drafter'} bound)"])
    N_bal = bal["anchors_balancing_64_layer_target"]
    rec.finish(f"I {I_full:.3f} s/row ({n_f} layers) -> {I64:.3f} s at 64 layers; T({N0}) {T[N0]:.3f} s; "
               + (f"P {P:.3f} s (P/(I+T) {P / (I_full + T[N0]):.2f}); " if P else "P skipped; ")
               + (f"balance at ~{N_bal:.0f} anchors/row" if N_bal else "no balance point"))
