"""GPU check, step d': the target's feature forward at Qwen3.6 width, in TFLOP/s and % of the bf16 peak.

Paths, each through the package's public `TargetFeatures` (so what is measured is what the trainer runs): the
linear-attention kernels as installed (flash-linear-attention, carried with `gpu_check.sh --wheels`) and transformers'
torch reference, each padded (length buckets) and packed (one unpadded forward per row), where `packed_support` allows;
the path `packing="auto"` picks; and a dense (Qwen3-code) stack of the same width. Packed must give the per-document
features: every packed path is compared with the padded one (each document in its own sequence) on the same row.
"""
from __future__ import annotations

import contextlib
import functools
import time

from _common import matmul_tflops, sync
from gpu_common import device_for
from gpu_flops import FLOP_FORMULA, full_depth_flops_per_token, peak_tflops, target_row_flops
from gpu_models import TARGET_DIMS, dense_target, hybrid_target, spread_ids
from gpu_plan import need

EPOCH_TOKENS = 1.87e9     # the data set the projection is for
TARGET_STEP = {  # depth of the reduced target, rows timed per (variant, packing) after a warm-up row
    False: dict(layers=8, row=4096, rows=3, warmup=1, samples=400, matmul=8192),
    True: dict(layers=8, row=96, rows=1, warmup=0, samples=40, matmul=256),
}
PACKED_TOL = 5e-2         # bf16: max |packed - per document| / max |per document| (a document leaking is O(1))


def reference_kernels(model):
    "Context manager: the hybrid's linear-attention layers run transformers' torch reference (the kernels unbound)."
    from dflash_nb import target as tmod
    mod = tmod._linear_attention_module(model)

    @contextlib.contextmanager
    def ctx():
        saved = {n: getattr(mod, n) for n in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
        try:
            for n, fn in saved.items():
                setattr(mod, n, getattr(fn, "__wrapped__", fn))   # functools.wraps keeps the torch function there
            yield
        finally:
            for n, fn in saved.items():
                setattr(mod, n, fn)
    return ctx()


def target_rows(p, dims):
    "Packed rows of the thinking-trace length mix (the trainer's row packing) and their document lengths."
    from dflash_nb.rows import RowStream
    from target_packing import length_mix, make_rows
    lengths = [min(n, p["row"]) for n in length_mix(p["samples"], mean=2000 * p["row"] / 4096)]
    rows_idx = RowStream(lengths, p["row"], seed=0).epoch_rows(0)[:p["warmup"] + p["rows"]]
    return make_rows(lengths, rows_idx, dims["vocab_size"], row=p["row"]), [[lengths[i] for i in r] for r in rows_idx]


def packed_vs_per_document(tf_packed, tf_padded, row, doc_lengths) -> dict:
    "Packed features against the padded path's (every document its own sequence) on one row: relative max errors."
    import torch
    a = tf_packed(row["input_ids"], row["doc_ids"]).float()
    b = tf_padded(row["input_ids"], row["doc_ids"]).float()
    real = row["doc_ids"].to(a.device) >= 0
    scale = b[real].abs().max().clamp_min(1e-30)
    starts = torch.tensor([0] + doc_lengths[:-1]).cumsum(0)[1:]        # where a leak from the previous document shows
    heads = torch.cat([torch.arange(s, s + 4) for s in starts.tolist()]) if len(starts) else torch.zeros(0).long()
    heads = heads[heads < a.shape[0]].to(a.device)
    err = float((a[real] - b[real]).abs().max() / scale)
    err_heads = float((a[heads] - b[heads]).abs().max() / scale) if heads.numel() else 0.0
    return dict(max_rel_err=err, max_rel_err_first_4_tokens_of_later_documents=err_heads, tol=PACKED_TOL,
                ok=err <= PACKED_TOL, documents=len(doc_lengths))


class TargetStep:
    "Measures one path after another into the step record, each skipped when its planned seconds no longer fit."
    def __init__(self, a, rec, p, ids, rows, timed_lengths, dev):
        self.a, self.rec, self.p, self.ids, self.rows, self.timed, self.dev = a, rec, p, ids, rows, timed_lengths, dev
        self.real = sum(sum(d) for d in timed_lengths)
        from target_packing import row_costs
        self.padded = sum(row_costs(d)["padded"] for d in timed_lengths)

    def measure(self, key, model, packing, useful_flops, peaks):
        "Time the feature forward of `model` over the timed rows on one path; record TFLOP/s and % of each peak."
        from dflash_nb.target import TargetFeatures
        if not self.rec.fits(key, need("target", "run", self.a.dry_run)):
            return None
        try:
            tf = TargetFeatures(model, self.ids, packing=packing)
            for r in self.rows[:self.p["warmup"]]:
                tf(r["input_ids"], r["doc_ids"])
            sync(self.dev)
            t = time.perf_counter()
            for r in self.rows[self.p["warmup"]:]:
                tf(r["input_ids"], r["doc_ids"])
            sync(self.dev)
            secs = time.perf_counter() - t
            tflops = useful_flops / secs / 1e12
            pct = {k: 100 * tflops / v if v else None for k, v in peaks.items()}
            self.rec["runs"][key] = dict(path=tf.packing, path_reason=tf.packing_reason, seconds=secs,
                                         seconds_per_row=secs / len(self.timed), useful_tflops=tflops,
                                         percent_of_peak=pct["datasheet"], percent_of_matmul_peak=pct["matmul"],
                                         tokens_computed=self.padded if tf.packing == "padded" else self.real)
            print(f"[target] {key} ({tf.packing}): {secs / len(self.timed):.4f} s/row, {tflops:.1f} TFLOP/s"
                  + (f" ({pct['datasheet']:.1f}% of {peaks['datasheet']:.0f})" if pct["datasheet"] else ""), flush=True)
            return tf
        except Exception as e:
            self.rec.error(key, e)
        finally:
            self.rec.save()

    def check_packed(self, key, model):
        "Packed = per-document features on the first timed row, for the path `key`."
        from dflash_nb.target import TargetFeatures
        if not self.rec.fits(f"{key} = per document", need("target", "check", self.a.dry_run)):
            return
        try:
            r = self.rows[self.p["warmup"]]
            res = packed_vs_per_document(TargetFeatures(model, self.ids, packing="packed"),
                                         TargetFeatures(model, self.ids, packing="padded"), r, self.timed[0])
            self.rec["packed_equals_per_document"][key] = res
            print(f"[target] {key}: packed vs per document max rel err {res['max_rel_err']:.2e} "
                  f"({'ok' if res['ok'] else 'FAIL'})", flush=True)
            if not res["ok"]:
                self.rec.error(f"{key} packed = per document", AssertionError(f"max rel err {res['max_rel_err']:.3g}"))
        except Exception as e:
            self.rec.error(f"{key} packed = per document", e)
        self.rec.save()


def step_target(a, rec):
    import torch
    from dflash_nb.target import TargetFeatures, fast_paths, packed_support
    dev, p, dims = device_for(a.dry_run), TARGET_STEP[a.dry_run], TARGET_DIMS[a.dry_run]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)"
    peaks = dict(datasheet=peak_tflops(name, a.peak_tflops), matmul=matmul_tflops(dev, p["matmul"], dtype, 5))
    target = hybrid_target(dev, dims, p["layers"], dtype)
    ids = spread_ids(p["layers"] - 2)
    rows, doc_lengths = target_rows(p, dims)
    timed = doc_lengths[p["warmup"]:]
    useful = sum(target_row_flops(target, max(ids), d) for d in timed)
    report = fast_paths(target)
    kernels_bound = report["linear_attention_kernel"] != "torch reference"
    s = TargetStep(a, rec, p, ids, rows, timed, dev)
    auto = TargetFeatures(target, ids)
    rec.update(device=name, dtype=str(dtype)[6:], peak_bf16_tflops=peaks["datasheet"],
               matmul_peak_tflops=peaks["matmul"], flop_formula=FLOP_FORMULA,
               target=dict(layers=p["layers"], feature_ids=ids, **dims), fast_paths=report,
               auto_path=dict(packing=auto.packing, reason=auto.packing_reason),
               rows=dict(tokens=p["row"], timed=len(timed), doc_lengths=timed, real_tokens=s.real,
                         padded_tokens=s.padded, useful_tflop=useful / 1e12),
               runs={}, packed_equals_per_document={},
               timing="wall clock of the feature forward over the timed rows after warm-up, synchronised")
    variants = [("kernels", contextlib.nullcontext)] if kernels_bound else []
    variants.append(("reference", functools.partial(reference_kernels, target)))
    if not kernels_bound:
        rec.skip("kernels", "flash-linear-attention is not installed (carry it with --wheels DIR: "
                            "bash bench/gpu_wheels.sh DIR)")
    for variant, ctx in variants:
        with ctx():
            supported, why = packed_support(target)
            for packing in ("padded", "packed"):
                key = f"{variant}/{packing}"
                if packing == "packed" and not supported:
                    rec.skip(key, why)
                    continue
                s.measure(key, target, packing, useful, peaks)
                if packing == "packed":
                    s.check_packed(key, target)
    hybrid_runs = dict(rec["runs"])
    per_token = full_depth_flops_per_token(target, doc_lengths)
    del target, auto
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if rec.fits("dense", need("target", "dense", a.dry_run)):  # the same width, every layer full attention (Qwen3 code)
        dense = dense_target(dev, dims, p["layers"], dtype)
        useful_dense = sum(target_row_flops(dense, max(ids), d) for d in timed)
        rec["dense"] = dict(model="qwen3 architecture at the same width and depth", useful_tflop=useful_dense / 1e12)
        for packing in ("padded", "packed"):
            s.measure(f"dense/{packing}", dense, packing, useful_dense, peaks)
        if "dense/packed" in rec["runs"]:
            s.check_packed("dense/packed", dense)
        del dense
    if not hybrid_runs:
        return rec.finish("no hybrid target forward measured")
    finish(rec, hybrid_runs, per_token)


def finish(rec, hybrid_runs, per_token):
    "The epoch projection from the hybrid's fastest path, and the headline."
    best_key = max(hybrid_runs, key=lambda k: hybrid_runs[k]["useful_tflops"])
    best = hybrid_runs[best_key]["useful_tflops"] * 1e12
    hours = EPOCH_TOKENS * per_token / (2 * best) / 3600
    rec["projection"] = dict(
        path=best_key, flops_per_token_64_layer=per_token, epoch_tokens=EPOCH_TOKENS, target_gpus=2,
        hours_per_epoch=hours,
        arithmetic=f"{EPOCH_TOKENS:.3g} tokens x {per_token / 1e9:.1f} GFLOP/token / (2 target GPUs x "
                   f"{best / 1e12:.1f} TFLOP/s, {best_key}) = {hours:.2f} h per epoch of the target forward",
        assumption="the 64-layer target runs at the TFLOP/s measured on the reduced one; two pairs = two target GPUs")
    pct = lambda v: f" ({v['percent_of_peak']:.0f}%)" if v["percent_of_peak"] else ""   # noqa: E731
    checks = rec["packed_equals_per_document"]
    rec.finish(" | ".join(f"{k} {v['useful_tflops']:.1f} TFLOP/s{pct(v)}" for k, v in rec["runs"].items())
               + (f" | packed = per document: {sum(c['ok'] for c in checks.values())}/{len(checks)} ok" if checks
                  else "")
               + f" | epoch of {EPOCH_TOKENS / 1e9:.2f}B tokens on 2 pairs: {hours:.1f} h ({best_key})")
