"""Pipeline efficiency of the online trainer: how close the pipelined loop comes to its slower stage.

Measures, on the current device and in one run:
  I  target-forward-only throughput (tokens/s): the producer's work alone;
  T  drafter-train-only throughput (tokens/s) on precomputed features: the consumer's work alone (the trainer's own
     `train_step` with the config's loss, D-PACE by default);
  P  the full pipelined trainer (`dflash_nb.trainer.train`), steady state (first log interval dropped).
and prints P / min(I, T) (pipeline efficiency; 1.0 is the limit when target and drafter have their own devices) and
P / (1 / (1/I + 1/T)) (against the serial bound, the limit when they share one device).
Targets on GPU: >= 0.9 on split devices, >= 0.95 of the serial bound on one device. On CPU the figures are reported
without a target (the producer thread and the drafter share the same two cores).

    python bench/pipeline.py                      # CPU: tiny target, small drafter
    python bench/pipeline.py --device cuda        # GPU: ~4B-parameter random-weight Qwen3 target (Qwen3-4B shape)
    python bench/pipeline.py --device cuda --split   # target on cuda:0, drafter on cuda:1 (needs 2 GPUs)

Writes bench/results/pipeline.json (or --out).
"""
from __future__ import annotations
import argparse, json, os, platform, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch

PRESETS = {
    # a tiny target and drafter: the CPU figures are about the machinery, not about speed
    "cpu": dict(target=dict(hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32,
                            intermediate_size=384, seed=0),
                drafter=dict(num_hidden_layers=1, block_size=8), max_tokens=512, max_anchors=32, approx_tokens=200,
                steps=12),
    # Qwen3-4B's shape with random weights (~4.0B parameters, bf16): a realistic target for one H200
    "cuda": dict(target=dict(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                             intermediate_size=9728, seed=0),
                 drafter=dict(num_hidden_layers=5, block_size=16), max_tokens=4096, max_anchors=512,
                 approx_tokens=1800, steps=30),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                    help="default: cuda when present")
    ap.add_argument("--split", action="store_true", help="target on cuda:0, drafter on cuda:1")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per phase")
    ap.add_argument("--warmup", type=int, default=3,
                    help="unmeasured steps per phase (also the trainer's log interval)")
    ap.add_argument("--backend", default="auto", help="drafter attention backend (auto = the probe)")
    ap.add_argument("--out", default=None, help="default bench/results/pipeline.json (GPU) or pipeline-cpu.json (CPU)")
    a = ap.parse_args(argv)
    from dflash_nb.config import from_dict
    from dflash_nb.records import qwen3_tokenizer_dir, load_tokenizer, DataConfig
    from dflash_nb.inputs import synthetic_records, write_jsonl
    from dflash_nb.shards import tokenize_dataset
    from dflash_nb.build import drafter_config, build_drafter, pick_backend
    from dflash_nb.rows import RowStream, make_batch
    from dflash_nb.train_config import TrainConfig
    from dflash_nb.trainer import train, load_samples
    from dflash_nb.target import TargetFeatures, tiny_target
    from _common import Batches, now_iso, sync, train_steps, trainer_run, with_features, write_json

    p = PRESETS[a.device]
    steps = a.steps or p["steps"]
    if a.device == "cuda":
        if not torch.cuda.is_available(): sys.exit("--device cuda: no CUDA device")
        if a.split and torch.cuda.device_count() < 2: sys.exit("--split needs 2 GPUs")
        tdev, ddev = torch.device("cuda:0"), torch.device("cuda:1" if a.split else "cuda:0")
    else:
        tdev = ddev = torch.device("cpu")
    shared = tdev == ddev
    load_start = os.getloadavg()[0]   # the CPU figures are only as good as the machine was quiet
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    n_samples = max(64, (steps + a.warmup + 4) * 2 * max(1, p["max_tokens"] // p["approx_tokens"]))
    src = write_jsonl(synthetic_records(n_samples, seed=0, approx_tokens=p["approx_tokens"]), work / "data.jsonl")
    tokenize_dataset([str(src)], qwen3_tokenizer_dir(), work / "data",
                     DataConfig(workers=1, max_seq_len=p["max_tokens"]), verbose=False)

    t0 = time.perf_counter()
    with torch.device(tdev):   # built on the device: no host copy of a 4B-parameter target
        target = tiny_target(**p["target"], dtype=torch.bfloat16 if a.device == "cuda" else torch.float32)
    n_target = sum(x.numel() for x in target.parameters())
    print(f"target: {n_target / 1e9:.2f}B parameters on {tdev} ({time.perf_counter() - t0:.1f}s to build); drafter on "
          f"{ddev}", flush=True)

    cfg = from_dict(TrainConfig, dict(run_dir=str(work / "run"), data_dir=str(work / "data"), steps=a.warmup + steps,
                                      global_batch=1, max_tokens=p["max_tokens"], max_anchors=p["max_anchors"],
                                      backend=a.backend, devices=[[str(tdev), str(ddev)]], log_every=a.warmup,
                                      drafter=p["drafter"], checkpoint=dict(every=0, final=False)))
    tok = load_tokenizer(qwen3_tokenizer_dir())
    dcfg = drafter_config(target, cfg.drafter, tok)
    feats = TargetFeatures(target, dcfg.target_layer_ids, max_batch_tokens=cfg.target.max_batch_tokens)
    samples = load_samples(cfg.data_dir)
    stream = RowStream([int(n) for n in samples.lengths], cfg.max_tokens, cfg.seed)
    rows = [make_batch(samples, stream, k, k, 0, max_tokens=cfg.max_tokens, block_size=dcfg.block_size,
                       max_anchors=cfg.max_anchors, mask_token_id=dcfg.mask_token_id, seed=cfg.seed)
            for k in range(a.warmup + steps)]
    ntok = [r.n_tokens for r in rows]

    # ---- I: target forward only ----------------------------------------------------------------------------------
    def target_phase():
        out = []
        for i, r in enumerate(rows):
            if i == a.warmup:
                sync(tdev)
                t = time.perf_counter()
            out.append(feats(r.input_ids, r.doc_ids).to(ddev))
        sync(tdev)
        sync(ddev)
        return sum(ntok[a.warmup:]) / (time.perf_counter() - t), out
    I, features = target_phase()
    print(f"I  target forward only : {I:12,.0f} tokens/s", flush=True)

    # ---- T: drafter training only (features precomputed, already on the drafter device) --------------------------
    drafter = build_drafter(dcfg, feats, ddev, cfg.seed)
    backend, why = pick_backend(cfg.backend, ddev, torch.bfloat16 if ddev.type == "cuda" else torch.float32, dcfg,
                                cfg.max_tokens, cfg.max_anchors)
    print(f"attention backend: {backend} ({why})", flush=True)
    # the trainer's own train_step (its step_loss under the config's loss: D-PACE by default), one row per step
    run = trainer_run(cfg, drafter, dcfg, feats, ddev, backend, why)
    prepared = Batches(with_features(r, f, ddev) for r, f in zip(rows, features))
    seconds = sum(train_steps(run, prepared, steps, a.warmup, each=False))
    T = sum(ntok[a.warmup:]) / seconds
    print(f"T  drafter train only  : {T:12,.0f} tokens/s", flush=True)
    del drafter, run, prepared, features
    if ddev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ddev)

    # ---- P: the real pipelined trainer ---------------------------------------------------------------------------
    s = train(cfg, target=target)
    recs = [json.loads(l) for l in (work / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    steady = recs[1:]                       # the first interval (warm-up, producer filling the queue) is dropped
    P = sum(r["tokens_per_s"] * r["wall_s"] for r in steady) / sum(r["wall_s"] for r in steady)
    busy = {k: sum(r[k] * r["wall_s"] for r in steady) / sum(r["wall_s"] for r in steady)
            for k in ("target_busy", "drafter_busy", "drafter_wait")}
    print(f"P  pipelined trainer   : {P:12,.0f} tokens/s  (target busy {busy['target_busy']:.0%}, drafter busy "
          f"{busy['drafter_busy']:.0%}, drafter waiting {busy['drafter_wait']:.0%})", flush=True)

    serial = 1 / (1 / I + 1 / T)
    eff_split, eff_serial = P / min(I, T), P / serial
    cuda = a.device == "cuda"
    res = {"device": str(tdev) + (" -> " + str(ddev) if not shared else ""), "shared_device": shared,
           "gpu": torch.cuda.get_device_name(tdev) if tdev.type == "cuda" else None,
           "cpu": platform.processor() or platform.machine(), "cpu_threads": torch.get_num_threads(),
           "torch": torch.__version__, "target_params": n_target, "target": p["target"],
           "drafter": {**p["drafter"], "hidden_size": dcfg.hidden_size,
                       "params": sum(x.numel() for x in s["drafter"].parameters())},
           "attention_backend": backend, "loss_weighting": cfg.loss.weighting, "finished": now_iso(),
           "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()},
           "rows": {"max_tokens": cfg.max_tokens, "max_anchors": cfg.max_anchors, "mean_tokens": sum(ntok) / len(ntok)},
           "steps": steps, "warmup": a.warmup, "I_tokens_per_s": I, "T_tokens_per_s": T, "P_tokens_per_s": P,
           "serial_bound_tokens_per_s": serial, "P_over_min_I_T": eff_split, "P_over_serial_bound": eff_serial,
           "busy": busy, "peak_mem_gb": recs[-1]["peak_mem_gb"] if recs else None,
           "target_ratio": (">= 0.95 of the serial bound" if shared else ">= 0.9 of min(I, T)") if cuda else None,
           "meets_target": bool(eff_serial >= 0.95 if shared else eff_split >= 0.9) if cuda else None}
    print(f"P / min(I, T)          = {eff_split:.3f}   (1.0 is the limit for split devices)")
    print(f"P / serial bound       = {eff_serial:.3f}   (serial bound 1/(1/I + 1/T) = {serial:,.0f} tokens/s; "
          "the limit on one shared device)")
    if a.device == "cpu": print("CPU: reported without a target (producer and drafter share the cores)")
    else: print(f"target {res['target_ratio']}: {'met' if res['meets_target'] else 'NOT met'}")
    out = Path(a.out or ROOT / "bench" / "results" / ("pipeline.json" if a.device == "cuda" else "pipeline-cpu.json"))
    write_json(out, res)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
