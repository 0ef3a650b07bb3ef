"""GPU check, steps b, c and c': the drafter's attention backends: parity, speed (and the `auto` choice), tile sweep."""
from __future__ import annotations

import json
import math
import time
import traceback
from pathlib import Path

from gpu_common import allow_recompiles, device_for, short_error, sync
from gpu_plan import need

BF16_EPS = 2.0 ** -7      # spacing of bfloat16 at 1.0
PROJECT_TOL = 5e-2        # the project's bf16 parity tolerance (dflash_nb.attention's probe), relative to max |ref|

# ---- shapes ----------------------------------------------------------------------------------------------------------
# H, HKV, D: query heads, kv heads, head_dim; S context tokens, N anchors, B block size, docs per row, W sliding window
FLAGSHIP = dict(H=24, HKV=4, D=256, S=4096, N=512, B=16, docs=6, W=2048)

ATTN_CASES = {  # in order of value: the flagship shape first, then the cheap ones that localise a failure
    False: {  # GPU
        "flagship": FLAGSHIP,
        "narrow_window": dict(H=24, HKV=4, D=256, S=256, N=12, B=16, docs=2, W=8),   # W < B: the per-row window
        "reduced": dict(H=24, HKV=4, D=256, S=512, N=32, B=16, docs=3, W=128),
    },
    True: {   # dry run on CPU
        "flagship": dict(H=4, HKV=2, D=32, S=64, N=4, B=8, docs=2, W=16),
        "narrow_window": dict(H=2, HKV=1, D=32, S=32, N=3, B=8, docs=1, W=4),
        "reduced": dict(H=2, HKV=1, D=32, S=32, N=2, B=8, docs=2, W=12),
    },
}


# ---- b. parity -------------------------------------------------------------------------------------------------------
def reference64(q, k, v, dout, mask, scale):
    "Float64 dense attention forward and dq, dk, dv, one kv head (and its query group) at a time to bound memory."
    import torch
    H, HKV = q.shape[1], k.shape[1]
    G = H // HKV
    outs, dqs, dks, dvs = [], [], [], []
    for j in range(HKV):
        qj = q[:, j * G:(j + 1) * G].double().requires_grad_()
        kj = k[:, j:j + 1].double().requires_grad_()
        vj = v[:, j:j + 1].double().requires_grad_()
        with torch.enable_grad():
            s = (qj @ kj.transpose(-1, -2)) * scale
            o = s.masked_fill(~mask, float("-inf")).softmax(-1) @ vj
            o.backward(dout[:, j * G:(j + 1) * G].double())
        outs.append(o.detach())
        dqs.append(qj.grad)
        dks.append(kj.grad)
        dvs.append(vj.grad)
        del s, o
    return dict(out=torch.cat(outs, 1), dq=torch.cat(dqs, 1), dk=torch.cat(dks, 1), dv=torch.cat(dvs, 1))


def rel_err(x, ref, rows=None):
    "max |x - ref| / max |ref| (over the query rows that see at least one key, where given)."
    d, r = (x.double() - ref).abs(), ref.abs()
    if rows is not None:
        d, r = d[..., rows, :], r[..., rows, :]
    return float(d.max() / r.max().clamp_min(1e-30)) if d.numel() else 0.0


def run_backend(name, layout, q, k, v, dout, window, causal):
    "Output and (dq, dk, dv) of one backend through the public call; grads None where the backend has no backward here."
    import torch
    from dflash_nb.attention import anchor_block_attention
    grad = not (name == "flex" and q.device.type == "cpu")
    qq, kk, vv = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    with torch.set_grad_enabled(grad):
        o = anchor_block_attention(qq, kk, vv, window=window, causal_in_block=causal, backend=name, layout=layout)
        if grad:
            o.backward(dout)
    sync(q.device)
    return o.detach(), (qq.grad, kk.grad, vv.grad) if grad else None


def step_parity(a, rec):
    import torch
    from attention import attention_inputs
    dev = device_for(a.dry_run)
    allow_recompiles()
    cases = ATTN_CASES[a.dry_run]
    rec["tolerance"] = (
        f"sdpa: err <= {PROJECT_TOL} (the project's bf16 tolerance); triton and flex: err <= 3 * err_sdpa "
        f"+ 2 * eps_bf16 ({2 * BF16_EPS:.4f}); err = max|x - ref64| / max|ref64| per tensor, over query rows "
        f"that see at least one key for out and dq"
    )
    rec["cases"] = []
    # gpu_plan keeps, per (case, kind), the seconds of its compiles: flex compiles once per shape and kind (the first
    # compile of a process takes longest), the kernel once per head_dim and in-block causality
    n_ok = n_bad = 0
    for cname, c in cases.items():
        kinds = [(c["W"], True)] if cname == "narrow_window" else [(None, False), (c["W"], True)]
        for window, causal in kinds:
            label = f"{cname} {'sliding W=%d' % window if window else 'full'}"
            if not rec.fits(label, need("parity", cname, a.dry_run)):
                continue
            print(f"[parity] {label}: H={c['H']}/{c['HKV']} D={c['D']} S={c['S']} N={c['N']} B={c['B']}", flush=True)
            t0 = time.perf_counter()
            entry = dict(case=cname, **c, window=window, causal_in_block=causal, backends={})
            rec["cases"].append(entry)
            try:
                layout, q, k, v, dout = attention_inputs(dev, c)
                mask = layout.dense_mask(window, causal)
                rows = mask.any(1)
                a_kept = layout.anchors[layout.keep]
                entry.update(visible_pairs=int(mask.sum()), empty_query_rows=int((~rows).sum()),
                             anchors_past_W_minus_B_plus_1=int((a_kept > window - c["B"] + 1).sum()) if window
                             else None)
                ref = reference64(q, k, v, dout, mask, 1 / math.sqrt(c["D"]))
            except Exception as e:
                rec.error(f"{label}: reference", e)
                continue
            for name in ("sdpa", "triton", "flex"):
                try:
                    o, grads = run_backend(name, layout, q, k, v, dout, window, causal)
                    r = dict(out=rel_err(o, ref["out"], rows))
                    if grads is None:
                        r["grads"] = "not run: torch has no flex_attention backward on CPU (dry run)"
                    else:
                        r.update(dq=rel_err(grads[0], ref["dq"], rows), dk=rel_err(grads[1], ref["dk"]),
                                 dv=rel_err(grads[2], ref["dv"]))
                    r["finite"] = all(bool(torch.isfinite(t).all()) for t in (o, *(grads or ())))
                except Exception as e:
                    r = dict(error=short_error(e), traceback=traceback.format_exc()[-1500:])
                entry["backends"][name] = r
                rec.save()
            base = entry["backends"].get("sdpa", {})
            for name, r in entry["backends"].items():
                errs = {t: r[t] for t in ("out", "dq", "dk", "dv") if isinstance(r.get(t), float)}
                if not errs:
                    r["ok"] = False
                    continue
                bound = {t: PROJECT_TOL if name == "sdpa" or not isinstance(base.get(t), float)
                         else 3 * base[t] + 2 * BF16_EPS for t in errs}
                r["bound"] = bound
                r["ok"] = r.get("finite", False) and all(errs[t] <= bound[t] for t in errs)
                n_ok += r["ok"]
                n_bad += not r["ok"]
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            fmt = lambda r, t: f"{r[t]:.1e}" if isinstance(r.get(t), float) else "-"   # noqa: E731
            line = lambda r: (" ".join(f"{t} {fmt(r, t)}" for t in ("out", "dq", "dk", "dv"))   # noqa: E731
                              + (" ok" if r["ok"] else " FAIL")) if "out" in r else r.get("error", "?")[:160]
            print("   " + "  ".join(f"{n}: {line(r)}" for n, r in entry["backends"].items()), flush=True)
            del layout, q, k, v, dout, ref, mask
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rec.save()
    worst = {}
    for e in rec["cases"]:
        for n, r in e["backends"].items():
            errs = [r[t] for t in ("out", "dq", "dk", "dv") if isinstance(r.get(t), float)]
            worst[n] = max([worst.get(n, 0.0)] + errs)
    rec["worst_err"] = worst
    rec["all_ok"] = n_bad == 0 and n_ok > 0
    rec.finish(f"{n_ok}/{n_ok + n_bad} backend x case checks within bounds; worst err " +
               ", ".join(f"{n} {w:.1e}" for n, w in worst.items()) +
               (f"; {len(rec['skipped'])} case(s) skipped" if rec["skipped"] else ""))


# ---- c. speed --------------------------------------------------------------------------------------------------------
def step_speed(a, rec):
    import tempfile
    import torch
    from attention import add_speedups, attention_inputs, bench_one, make_backends, useful_flops, visible_pairs
    dev = device_for(a.dry_run)
    allow_recompiles()
    c = FLAGSHIP if not a.dry_run else ATTN_CASES[True]["reduced"]
    iters = 10 if not a.dry_run else 1
    rec.update(shape=c, dtype="bfloat16", iters=iters, timing="median of iters after warm-up, " +
               ("CUDA events" if dev.type == "cuda" else "wall clock (dry run)"),
               flops="useful FLOPs: forward 4*pairs*D*H, backward 10*pairs*D*H, pairs = True entries of the dense mask")
    layout, q, k, v, dout = attention_inputs(dev, c)
    rec["runs"] = []
    for kind, (window, causal) in (("sliding", (c["W"], True)), ("full", (None, False))):
        pairs = visible_pairs(layout, window, causal)
        f_fwd, f_bwd = useful_flops(pairs, c["H"], c["D"])
        run = dict(kind=kind, window=window, causal_in_block=causal, visible_pairs_per_head=pairs,
                   density=pairs / (layout.num_queries * layout.kv_len), backends={})
        rec["runs"].append(run)
        fns = make_backends(layout, window, causal)
        for name in ("triton", "flex", "sdpa"):
            if not rec.fits(f"{kind} {name}", need("speed", name, a.dry_run)):
                continue
            t0 = time.perf_counter()
            backward = not (name == "flex" and dev.type == "cpu")
            try:
                r, _ = bench_one(fns[name], q, k, v, dout, iters, backward=backward)
                r["tflops_fwd"] = f_fwd / r["ms_fwd"] / 1e9
                if backward:
                    r["tflops_fwd_bwd"] = (f_fwd + f_bwd) / r["ms_fwd_bwd"] / 1e9
                else:
                    r["fwd_bwd"] = "not run: torch has no flex_attention backward on CPU (dry run)"
            except Exception as e:
                r = dict(error=short_error(e), traceback=traceback.format_exc()[-1500:])
            r["wall_s"] = round(time.perf_counter() - t0, 2)
            run["backends"][name] = r
            print(f"[speed] {kind} {name}: " + ", ".join(f"{k_}={v_:.3g}" if isinstance(v_, float) else f"{k_}={v_}"
                                                          for k_, v_ in r.items() if k_ != "traceback"), flush=True)
            rec.save()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        add_speedups(run)
        rec.save()
    # the auto probe, as training runs it: the fastest of flex, triton, sdpa that work forward+backward on these
    # shapes and the flagship's layer list (4 sliding, 1 full)
    if rec.fits("auto probe", need("speed", "auto", a.dry_run)):
        # the dry run times the Triton interpreter: one layer of each kind, one timed step
        layers = [(c["W"], True)] * (1 if a.dry_run else 4) + [(None, False)]
        from dflash_nb.attention import select_backend
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as d:
                name, why = select_backend(dev, torch.bfloat16, c["H"], c["HKV"], c["D"], c["S"], c["N"], c["B"],
                                           kinds=layers, run_dir=d, verbose=False,
                                           timing_steps=1 if a.dry_run else 3)
                probe = json.loads((Path(d) / "attention_backend.json").read_text())
            rec["auto"] = dict(backend=name, reason=why, ms_per_step=probe.get("ms_per_step"), tried=probe.get("tried"),
                               seconds=round(time.perf_counter() - t0, 2))
            print(f"[speed] auto probe: {name} ({why})", flush=True)
        except Exception as e:
            rec["auto"] = dict(backend=None, error=short_error(e), seconds=round(time.perf_counter() - t0, 2))
        rec.save()
    parts = []
    for run in rec["runs"]:
        b = run["backends"]
        ms = " ".join(f"{n} {b[n]['ms_fwd_bwd']:.2f}" for n in ("triton", "flex", "sdpa")
                      if "ms_fwd_bwd" in b.get(n, {}))
        sp = run.get("speedup_triton_vs_flex_fwd_bwd")
        parts.append(f"{run['kind']} fwd+bwd ms: {ms or '-'}" + (f" (triton {sp:.2f}x flex)" if sp else ""))
    rec.finish("; ".join(parts) + f"; auto -> {rec.data.get('auto', {}).get('backend')}")


# ---- c'. tile sweep --------------------------------------------------------------------------------------------------
def step_sweep(a, rec):
    from attention import attention_inputs, make_backends, sweep
    dev = device_for(a.dry_run)
    c = FLAGSHIP if not a.dry_run else ATTN_CASES[True]["reduced"]
    iters = 5 if not a.dry_run else 1
    layout, q, k, v, dout = attention_inputs(dev, c)
    rec.update(shape=c, iters=iters, kinds={})
    kinds = (("sliding", (c["W"], True)), ("full", (None, False)))
    for kind, (window, causal) in kinds if not a.dry_run else kinds[:1]:   # dry run: one kind is enough
        if not rec.fits(f"sweep {kind}", need("sweep", "kind", a.dry_run)):
            continue
        fn = make_backends(layout, window, causal)["triton"]

        def record(res, kind=kind):
            rec["kinds"][kind] = res
            rec.save()
        try:
            sweep(q, k, v, dout, fn, c["D"], iters, record, time_left=rec.left,
                  need_s=need("sweep", "candidate", a.dry_run),
                  aot=not a.dry_run)
        except Exception as e:
            rec.error(f"sweep {kind}", e)
    best = {kind: {kern: r.get("best") for kern, r in res.items()} for kind, res in rec["kinds"].items()}
    rec["best"] = best
    rec.finish("best tiles " + "; ".join(f"{kind}: " + ", ".join(f"{kern} {b}" for kern, b in bb.items())
                                         for kind, bb in best.items()))

