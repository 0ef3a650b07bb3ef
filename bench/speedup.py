"""Does the drafter pay on this machine? The cost model measured on the real target, then vLLM's own sweep.

1. Cost model (Hugging Face transformers, the training environment): with the target's KV cache holding `--context`
   tokens of a held-out sample, the median wall time of one target step appending n tokens (n = 1, 2, 3, 4, 5, 8, 9,
   16, 17), relative to n = 1, in every `--dtypes`; the drafter's cost for one block proposal of n slots (the anchor
   and n - 1 masks) relative to one target step. A step that drafts k tokens verifies k + 1 (the last committed token
   and the k drafts), so with the drafter's per-position acceptance p_i (the share of cycles that accepted slot i,
   measured by the training run's held-out walk) the model predicts

       τ(k) = 1 + p_1 + … + p_k,   speed-up(k) = τ(k) / (verify(k + 1) + drafter(k + 1)),

   and the τ at which the drafter breaks even is verify(k + 1) + drafter(k + 1) (both relative to a 1-token step).
2. Sweep (vLLM CPU, the serving environment): `dflash-eval --engine vllm --num-speculative-tokens K... --batch-size
   1 16` on the held-out prompts of --prompts, greedy: per cell vLLM's acceptance length, output tokens/s
   without and with the drafter (the plain engine measured just before in the same run), identical outputs.

    python bench/speedup.py --run runs/smollm2 --target models/smollm2 --prompts HELD_OUT.jsonl
    python bench/speedup.py --run runs/smollm2 --target models/smollm2 --no-sweep      # the cost model only
    python bench/speedup.py --run R --target T --no-cost --no-sweep --curve --heldout DATA   # the τ curve only

3. τ curve (--curve): the held-out τ and per-slot acceptance of every checkpoint the run kept (the decoding walk on
   `--curve-samples` samples of the tokenized held-out data), with the training tokens seen by then (metrics.jsonl).

4. Fit (--fit): the same sweep with an untrained drafter of the same shape (τ ≈ 1) gives the cost of one speculative
   step in plain steps per cell, c(k, batch) = τ · plain tok/s / with tok/s, a property of the machine and vLLM; the
   trained drafter's speed-up is predicted as τ / c (from vLLM's τ, and from the held-out walk's τ(k) of a curve
   step) and set against what vLLM measured. --serve-dtypes float32 bfloat16 sweeps each.

    python bench/speedup.py --run R --target T --drafter EXPORT --prompts HELD_OUT.jsonl --heldout DATA --no-cost \
        --fit --serve-dtypes float32 bfloat16 --k 1 2 3 4 --batch 1 4 16 --out bench/results/speedup-cpu.json

Writes bench/results/speedup-cpu.json (or --out) after each part. With --no-cost the stages already in --out are kept
and a cut run resumes: checkpoints on the curve and serve dtypes whose sweep (and fit) finished are not measured again.
"""
from __future__ import annotations
import argparse, json, os, platform, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import now_iso, write_json  # noqa: E402
from dflash_nb.sweep import fit_step_costs, fit_with_tail, predict_speedups  # noqa: E402

STEP_TOKENS = (1, 2, 3, 4, 5, 8, 9, 16, 17)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def context_ids(run_dir: Path, target: Path, n: int):
    "`n` tokens of held-out samples (else the bundled prompts, chat-rendered): what the KV cache holds while timed."
    import torch
    ids = []
    if (run_dir / "data" / "heldout").is_dir():
        from dflash_nb.shards import read_shards
        ds = read_shards(run_dir / "data" / "heldout")
        for i in range(len(ds)):
            ids += list(ds[i]["input_ids"])
            if len(ids) >= n: break
    else:
        from dflash_nb.records import load_tokenizer
        from dflash_nb.train import demo_data_dir
        tok = load_tokenizer(str(target))
        for line in (demo_data_dir() / "prompts.jsonl").read_text().splitlines():
            rec = json.loads(line)
            msgs = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            ids += tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= n: break
    return torch.tensor(ids[:n])


def cost_model(run_dir: Path, target: Path, drafter_dir: Path, dtype: str, context: int, repeats: int,
               threads: int | None = None) -> dict:
    """Target step time per appended tokens and drafter proposal time per block, in `dtype`, relative to a 1-token step.

    The one-token step, the n-token step and the n-slot proposal are timed in turn within every repeat and the ratios
    taken per repeat (median over repeats): on a machine whose load moves, a ratio of two medians timed minutes apart
    says more about the load than about the step. The cache is cropped back to the context after every step."""
    import torch
    from transformers import DynamicCache
    from dflash_nb import decoding as D
    from dflash_nb.evaluate import load_drafter_dir
    from dflash_nb.target import load_target
    if threads: torch.set_num_threads(threads)
    model = load_target(str(target), dtype=dtype, device=torch.device("cpu"))
    drafter = load_drafter_dir(drafter_dir, model)
    prompt, rows, med = context_ids(run_dir, target, context), [], lambda xs: sorted(xs)[len(xs) // 2]
    for n in STEP_TOKENS:
        B, layer_ids, proposer, dev, prompt = D._loop_setup(drafter, model, prompt, max(n, 2), None, "sdpa")
        P, name = prompt.numel(), D._model_kwargs_cache_name(model)
        kw = {name: DynamicCache(config=model.config), "use_cache": True}
        with torch.inference_mode(), D.capture_layers(model, layer_ids) as store:
            model(input_ids=prompt[None], position_ids=torch.arange(P)[None], logits_to_keep=1, **kw)
            feats = D._features_from(store, layer_ids)
            saved = D.snapshot_linear_state(kw[name])
            def step(m):
                model(input_ids=prompt[-1:].expand(m)[None], position_ids=torch.arange(P, P + m)[None], **kw)
                D.restore_cache(kw[name], saved, P)
            seq, ctx = torch.cat([prompt, prompt[-1:]]), torch.cat([feats, feats.new_zeros(1, feats.shape[1])])
            propose = lambda: proposer.propose(seq, ctx, torch.tensor([P]))
            t1s, tns, tds = [], [], []
            for r in range(repeats + 1):
                ts = []
                for fn in (lambda: step(1), lambda: step(n), propose):
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                if r:   # the first round warms up
                    for xs, x in zip((t1s, tns, tds), ts): xs.append(x)
        rows.append(dict(tokens=n, target_1_ms=1e3 * med(t1s), target_ms=1e3 * med(tns),
                         verify=med([b / a for a, b in zip(t1s, tns)]), drafter_ms=1e3 * med(tds),
                         drafter=med([d / a for a, d in zip(t1s, tds)]), load=load()))
        print(f"{dtype}: {n:>2} tokens {rows[-1]['target_ms']:7.2f} ms = {rows[-1]['verify']:.2f} x one token "
              f"({rows[-1]['target_1_ms']:.2f} ms); drafter block of {max(n, 2)}: {rows[-1]['drafter']:.2f} x",
              flush=True)
    return {"dtype": dtype, "context_tokens": context, "repeats": repeats, "threads": torch.get_num_threads(),
            "drafter": str(drafter_dir), "steps": rows}


def run_summary(run_dir: Path) -> dict:
    "What was trained: steps, wall time, τ before/after and the per-position acceptance of the held-out walk."
    import yaml
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    rep = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    d = json.loads((run_dir / "drafter" / "config.json").read_text()) if (run_dir / "drafter").exists() else {}
    after = rep.get("tau_after") or {}
    return {"run_dir": str(run_dir), "steps": cfg.get("steps"), "max_tokens": cfg.get("max_tokens"),
            "max_anchors": cfg.get("max_anchors"), "lr": (cfg.get("optim") or {}).get("lr"),
            "block_size": d.get("block_size"), "drafter_layers": d.get("num_hidden_layers"),
            "train_wall_s": (rep.get("train") or {}).get("wall_s"),
            "train_steps_done": (rep.get("train") or {}).get("steps"),
            "tau_before": (rep.get("tau_before") or {}).get("tau"), "tau_after": after.get("tau"),
            "per_position": after.get("per_position"), "heldout_samples": after.get("samples")}


def tokens_seen(metrics: Path) -> dict[int, int]:
    "Training tokens seen by the end of each logged step: the sum of each interval's tokens/s × its wall seconds."
    seen, total = {}, 0.0
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        rec = json.loads(line)
        if "tokens_per_s" in rec and "wall_s" in rec:
            total += rec["tokens_per_s"] * rec["wall_s"]
            seen[rec["step"]] = round(total)
    return seen


def tau_curve(run_dir: Path, target: str, heldout: Path, samples: int, dtype: str = "float32",
              done=()) -> list[dict]:   # done: rows measured before (same samples): their steps are not walked again
    "Held-out τ and per-slot acceptance of every checkpoint the run kept (the decoding walk), with the tokens seen."
    import torch
    from dflash_nb.checkpoint import step_dirs, step_of
    from dflash_nb.evaluate import load_drafter_dir, load_target_spec
    from dflash_nb.target import TargetFeatures
    from dflash_nb.train import measure_tau
    model = load_target_spec(target, device="cpu", dtype=getattr(torch, dtype))   # a model dir, or "tiny"
    seen, rows = tokens_seen(run_dir / "metrics.jsonl"), [r for r in done if r["samples"] <= samples]
    for d in step_dirs(run_dir / "checkpoints"):
        if step_of(d.name) in {r["step"] for r in rows}: continue
        drafter = load_drafter_dir(d, model)
        feats = TargetFeatures(model, drafter.config.target_layer_ids)
        r = measure_tau(drafter, feats, heldout, samples, drafter.config.block_size)
        step = step_of(d.name)
        rows.append({"step": step, "tokens_seen": seen.get(step), "tau": r["tau"], "per_position": r["per_position"],
                     "samples": r["samples"], "load": load()})
        print(f"step {step}: τ {r['tau']:.3f} on {r['samples']} held-out samples, per slot "
              f"{' '.join(f'{p:.3f}' for p in r['per_position'][:4])}", flush=True)
    return sorted(rows, key=lambda r: r["step"])


def sweep_prompts(prompts: str, heldout: Path | None) -> tuple[Path, dict, dict]:
    "(prompt file, its template kwargs, what it is): the kwargs are those of the tokenized held-out data's manifest."
    man = heldout / "manifest.json" if heldout else None
    kwargs = (json.loads(man.read_text()).get("template_kwargs") or {}) if man and man.exists() else {}
    return Path(prompts).resolve(), kwargs, {"prompt_file": Path(prompts).name}


def sweep(run_dir: Path, target: Path, drafter: Path, prompts: tuple, ks, batches, dtype: str, max_new_tokens: int,
          max_prompts: int, tmp: Path, threads: int | None = None) -> tuple[dict, list]:
    "The real console script's sweep of `drafter` on the held-out `prompts` (`sweep_prompts`); its JSON and command."
    path, kwargs, about = prompts
    cmd = [str(Path(sys.executable).parent / "dflash-eval"), "--engine", "vllm", "--target", str(target), "--drafter",
           str(drafter), "--prompts", str(path), "--max-new-tokens", str(max_new_tokens), "--chat-template-kwargs",
           json.dumps(kwargs), "--max-prompts", str(max_prompts), "--dtype", dtype, "--num-speculative-tokens",
           *map(str, ks), "--batch-size", *map(str, batches), "--json", str(tmp / "eval.json")]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    res = json.loads((tmp / "eval.json").read_text())
    return {**res["vllm_sweep"], **about}, [c.replace(str(tmp), "$TMP") for c in cmd]


def untrained_like(drafter: Path, target: Path, out: Path, seed: int = 0) -> Path:
    "An export of `drafter`'s shape with fresh init weights: a drafter that is almost never right, whose cost is timed."
    import torch
    from dflash_nb.evaluate import load_drafter_dir, load_target_spec
    from dflash_nb.export import export_drafter
    d = load_drafter_dir(drafter, load_target_spec(str(target), device="cpu", dtype=torch.float32))
    torch.manual_seed(seed)
    d.reset_parameters()
    return Path(export_drafter(d, out_dir=out))


def fit_costs(trained: dict, untrained: dict, walk_per_position: list | None) -> list[dict]:
    "The fit of chapter 09d_sweep (`fit_step_costs`), a line per cell."
    rows = fit_step_costs(trained, untrained, walk_per_position)
    for row in rows:
        print(f"k {row['k']} batch {row['batch']}: step cost {row['step_cost']:.2f} plain steps, predicted "
              f"{row['predicted_speedup']:.2f}x, measured {row['measured_speedup']:.2f}x ({100 * row['error']:+.0f}%)"
              + (f"; from the walk's τ {row['walk_tau']:.2f}: {row['predicted_from_walk']:.2f}x" if "walk_tau" in row
                 else ""), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(ROOT / "runs" / "smollm2"),
                    help="finished training run (drafter/, report.json)")
    ap.add_argument("--target", default=str(ROOT / "models" / "smollm2"), help="the target's model directory")
    ap.add_argument("--drafter", default=None, help="the drafter served in the sweep and timed by the cost model "
                    "(default: the run's export)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="cost model dtypes")
    ap.add_argument("--context", type=int, default=256, help="tokens in the KV cache while a step is timed")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for the cost timing (default: torch's; 1 where other work oversubscribes)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 7], help="num_speculative_tokens to sweep")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--serve-dtypes", nargs="+", default=["bfloat16"], help="the dtypes vLLM serves in, a sweep each")
    ap.add_argument("--prompts", default=None, help="held-out prompt file for the sweep (e.g. dflash-prompt-set's "
                    "heldout.jsonl; needed unless --no-sweep)")
    ap.add_argument("--fit", action="store_true", help="also sweep an untrained drafter of the same shape and fit "
                    "the cost of a speculative step to it (predicted against measured, per cell)")
    ap.add_argument("--curve-step", type=int, default=None, help="the τ curve step whose walk acceptance predicts "
                    "the sweep (default: the last)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompts", type=int, default=16, help="held-out prompts served in every cell")
    ap.add_argument("--no-sweep", action="store_true", help="the cost model only")
    ap.add_argument("--curve", action="store_true", help="also the held-out τ of every checkpoint the run kept")
    ap.add_argument("--heldout", default=None, help="tokenized held-out data for --curve (default: the run's)")
    ap.add_argument("--curve-samples", type=int, default=64, help="held-out samples walked per checkpoint")
    ap.add_argument("--no-cost", action="store_true", help="the sweep only (the cost model kept from --out)")
    ap.add_argument("--prompt-set", default=None, help="prompt_set.json of dflash-prompt-set, recorded as the "
                    "prompt set's size and sources")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "speedup-cpu.json"))
    a = ap.parse_args(argv)
    if not a.no_sweep and not a.prompts: ap.error("--prompts: needed for the sweep (or --no-sweep)")
    run_dir, target, t0 = Path(a.run).resolve(), Path(a.target).resolve(), time.perf_counter()
    prev = json.loads(Path(a.out).read_text()) if a.no_cost and Path(a.out).exists() else {}
    tcfg = json.loads((target / "config.json").read_text()) if (target / "config.json").exists() else {}
    trained = run_summary(run_dir)
    out = {"bench": "speedup", "when": now_iso(), "host": platform.node(), "cpus": os.cpu_count(),
           "target": {"path": str(a.target), **{k: tcfg.get(k) for k in (
               "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "vocab_size")}},
           "drafter_training": trained, "load_start": load(), "note": a.note, "threads": a.threads,
           "cost_model": prev.get("cost_model", {})}
    for k in ("data", "comparisons", "sweeps", "sweep", "best", "sweep_command", "export"):   # kept: earlier stages
        if k in prev: out[k] = prev[k]
    if a.prompt_set: out["prompt_set"] = json.loads(Path(a.prompt_set).read_text())
    elif prev.get("prompt_set"): out["prompt_set"] = prev["prompt_set"]
    pp = trained["per_position"] or []
    if prev.get("tau_curve"): out["tau_curve"] = prev["tau_curve"]   # kept from --out unless measured again
    if a.curve:
        heldout = Path(a.heldout or run_dir / "data" / "heldout")
        out["tau_curve"] = tau_curve(run_dir, a.target, heldout, a.curve_samples, done=out.get("tau_curve", ()))
        write_json(a.out, {**out, "load_end": load(), "wall_s": round(time.perf_counter() - t0, 1)})
    if not a.no_cost:
        for dt in a.dtypes:
            out["cost_model"][dt] = cost_model(run_dir, target, Path(a.drafter or run_dir / "drafter"), dt, a.context,
                                               a.repeats, a.threads)
            write_json(a.out, {**out, "load_end": load(), "wall_s": round(time.perf_counter() - t0, 1)})
    for dt, costs in out["cost_model"].items():   # from the trained drafter's acceptance, whenever the costs were timed
        costs["predicted"] = predict_speedups(costs, pp, range(1, len(pp) + 1))   # every k the block allows
        for p in costs["predicted"]:
            print(f"{dt} k {p['k']}: τ(k) {p['tau']:.3f}, break-even τ {p['break_even_tau']:.3f}, "
                  f"predicted speed-up {p['predicted_speedup']:.2f}x", flush=True)
    if not a.no_sweep:
        drafter = Path(a.drafter or run_dir / "drafter").resolve()
        curve = {r["step"]: r for r in out.get("tau_curve") or prev.get("tau_curve") or []}
        walk = curve.get(a.curve_step if a.curve_step is not None else max(curve, default=None), {})
        with tempfile.TemporaryDirectory(prefix="dflash_nb-speedup-") as tmp:
            tmp = Path(tmp)
            prompts = sweep_prompts(a.prompts, Path(a.heldout) if a.heldout else None)
            for dt in a.serve_dtypes:
                done = out.get("sweeps", {}).get(dt, {})
                if "load_end" in done and (not a.fit or "fit" in done):   # finished in --out: a cut run resumes here
                    print(f"sweep {dt}: kept from {a.out}", flush=True)
                    continue
                out.setdefault("sweeps", {})[dt] = got = {"load_start": load()}
                got["trained"], out["sweep_command"] = sweep(run_dir, target, drafter, prompts, a.k, a.batch, dt,
                                                             a.max_new_tokens, a.max_prompts, tmp, a.threads)
                if a.fit:
                    blank = untrained_like(drafter, target, tmp / "untrained")
                    got["untrained"], _ = sweep(run_dir, target, blank, prompts, a.k, a.batch, dt, a.max_new_tokens,
                                                a.max_prompts, tmp, a.threads)
                    got["fit"] = fit_costs(got["trained"], got["untrained"], walk.get("per_position"))
                    got["fit_walk_step"] = walk.get("step")
                    got["fit_with_tail"] = fit_with_tail(got["trained"], got["untrained"])
                got["load_end"] = load()
                write_json(a.out, {**out, "load_end": load(), "wall_s": round(time.perf_counter() - t0, 1)})
        first = out["sweeps"][a.serve_dtypes[0]]["trained"]
        out["sweep"], out["best"] = first, first["best"]
        b = first["best"]
        print(f"best cell ({a.serve_dtypes[0]}): k {b['k']}, batch {b['batch']}: {b['plain_tokens_per_s']:.1f} -> "
              f"{b['tokens_per_s']:.1f} tok/s = {b['speedup']:.2f}x (τ {b['tau']:.3f})")
    out["load_end"], out["wall_s"] = load(), round(time.perf_counter() - t0, 1)
    print("wrote", write_json(a.out, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
