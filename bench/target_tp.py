"""The frozen target split tensor-parallel (chapter 07c_parallel): memory per rank and forward time, tp 2 against tp 1.

    python bench/target_tp.py [--out bench/results/target_tp.json]       # CPU, gloo, fp32 (a few minutes on 2 cores)

Measured (CPU): a Qwen3 dense and a Qwen3.5-style hybrid target (`dflash_nb.target.tiny_target`, hidden 1024, saved
once with `dflash_nb.parallel.saved_tiny_target`), each loaded in a 2-process torchrun run (gloo, OMP_NUM_THREADS=1
per rank) twice: whole on every rank (`load_target`, tp 1: what dp = 2 holds) and split over a TP group of 2
(`load_target_tp`). The machinery is the GPU check's step tp (`dflash_nb.gpu_target`, chapter 13c_gpu_target:
`launch`, `tp_worker`, `compare`): per rank the bytes of parameters it holds by kind, split vs replicated; its peak
RSS and the increase over the RSS before loading; the `TargetFeatures` forward of one packed row; and the features of
the split target against the whole one. On 2 shared cores tensor parallelism is not expected to be faster: this is a
correctness and memory bench.

Projected (arithmetic, no weights; the library's `dflash_nb.parallel.tp_fit`, chapter 07c_parallel): per-rank memory,
the smallest tp that fits 8 x 80 GB, the TP group's traffic per layer and hours per epoch for Qwen3.6-27B,
Llama-3.3-70B and Qwen3-235B-A22B, with the split/replicated status measured here per parameter and the H200 numbers
in bench/results/gpu_pipeline.json; every assumption is written into the JSON next to the number it makes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import now_iso, write_json   # noqa: E402  (bench/ is on sys.path from here on)
from dflash_nb.gpu_target import compare, launch, save_tp_targets, slim   # noqa: E402

HYBRID_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=12, linear_key_head_dim=64, linear_value_head_dim=64)
COMMON = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64, intermediate_size=3072,
              vocab_size=32768, full_attention_interval=4, pad_token_id=0, eos_token_id=1, seed=0)
SHAPE = dict(archs={"qwen3": COMMON, "qwen3_5": {**COMMON, **HYBRID_HEADS}}, docs=[200, 180, 132], warmup=1,
             repeats=5, dtype="float32", device="cpu")   # what is measured: tiny_target kwargs per arch, the row
LAUNCH_TIMEOUT_S = 600


# ---- the projection (the arithmetic is the library's: dflash_nb.parallel.tp_fit, chapter 07c_parallel) --------------
CARD_GB = 80
GPUS = 8
EPOCH_TOKENS = 1.87e9
ROW_TOKENS = 4096


def real_models() -> dict:
    "The three targets of the projection as transformers configs (text models) and the measured arch they follow."
    from transformers import LlamaConfig, Qwen3_5TextConfig, Qwen3MoeConfig
    from dflash_nb.gpu_target import TARGET_DIMS
    q36 = dict(TARGET_DIMS[False])
    return {
        "Qwen3.6-27B": dict(measured="qwen3_5", config=Qwen3_5TextConfig(
            **q36, num_hidden_layers=64, tie_word_embeddings=False,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]),
            note="text model only (its vision encoder is not a target); 3 Gated DeltaNet : 1 gated full attention"),
        "Llama-3.3-70B": dict(measured="qwen3", config=LlamaConfig(
            vocab_size=128256, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
            head_dim=128, intermediate_size=28672, tie_word_embeddings=False),
            note="dense; its parameters are named as Qwen3's minus the q/k norms, so the Qwen3 run's status applies"),
        "Qwen3-235B-A22B": dict(measured="qwen3", config=Qwen3MoeConfig(
            vocab_size=151936, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
            head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
            num_experts_per_tok=8, tie_word_embeddings=False),
            note="MoE: the experts and the router were not measured here: their status is transformers' plan's"),
    }


def h200_inputs() -> dict:
    "The measured inputs of the projection: bench/results/gpu_pipeline.json (one H200, Qwen3.6-27B width)."
    d = json.loads((HERE / "results" / "gpu_pipeline.json").read_text())
    lo, hi = d["rows"]["doc_len"]
    mean_n = (lo + hi) / 2
    mean_pairs = sum(n * (n + 1) / 2 for n in range(lo, hi + 1)) / (hi - lo + 1)
    weights = d["target"]["weights_gib"] * 2**30
    drafter_state = 16 * d["drafter"]["params"]
    t512 = d["phases"]["T"]["512"]
    return dict(
        source="bench/results/gpu_pipeline.json (one H200, bf16, 2026-11-30; Gated DeltaNet on transformers' torch "
               "reference, no fla kernels)",
        per_layer_s_per_row=d["extrapolation"]["per_layer_s"], row_tokens=d["rows"]["mean_tokens"],
        mean_context=mean_pairs / mean_n, drafter_step_s_512=t512["seconds_per_row"],
        drafter_params=d["drafter"]["params"],
        drafter_activations_gb=(t512["peak_gib"] * 2**30 - weights - drafter_state) / 1e9,
        target_activations_gb=(d["phases"]["I"]["peak_gib"] * 2**30 - weights) / 1e9,
        derivation="activations = measured peak - the 8-layer target's weights - the drafter's weights, gradients "
                   "and AdamW state (16 bytes per parameter): drafter step T(512 anchors, 4096-token rows) and "
                   "target forward I, both at hidden 5120")


def project_model(m: dict, status: dict, h: dict, sec_per_flop: float) -> dict:
    "One real target: `tp_fit` with the measured split status and the H200's activations and rate, plus epoch hours."
    from dflash_nb.parallel import ASSUMED_LINKS, layer_flops_per_token, tp_fit, tp_verdict
    c = m["config"]
    flops = layer_flops_per_token(c, h["mean_context"])
    t_layer_token = sec_per_flop * flops["per_layer"]
    act = (h["drafter_activations_gb"] + h["target_activations_gb"]) * c.hidden_size / 5120
    f = tp_fit(c, GPUS, CARD_GB, act, split=status, row_tokens=ROW_TOKENS, s_per_layer_token=t_layer_token)
    p, run_layers = f["params"], c.num_hidden_layers - 2            # the default feature ids end at L - 3
    drafter_s_token = h["drafter_step_s_512"] / h["row_tokens"] * f["drafter_params"] / h["drafter_params"]
    for r in f["rows"]:
        for link in ASSUMED_LINKS:
            # per micro-step a rank runs tp forwards split tp ways: its target time per token of its own row
            per_token = run_layers * t_layer_token / r[f"tp_efficiency_{link}"]
            r[f"target_hours_{link}"] = EPOCH_TOKENS / GPUS * per_token / 3600
            r[f"with_drafter_hours_{link}"] = EPOCH_TOKENS / GPUS * (per_token + drafter_s_token) / 3600
    n = p["split"] + p["whole"]
    return dict(
        note=m["note"], split_status_from=f"the {m['measured']} run measured here" +
        (f"; not measured, from transformers' plan: {p['from_plan']}" if p["from_plan"] else ""),
        params=n, active_params_per_token=n - p["experts"] * (
            1 - getattr(c, "num_experts_per_tok", 1) / getattr(c, "num_experts", 1)),
        kinds={k: dict(params=v["split"] + v["whole"], split_share=v["split"] / (v["split"] + v["whole"]))
               for k, v in p["kinds"].items()},
        heads=dict(q=f["heads"][0], kv=f["heads"][1], tp_max_by_heads=max(r["tp"] for r in f["rows"]
                                                                          if r["heads_divide"])),
        drafter_params=f["drafter_params"], layers_run=run_layers, flops_per_token_per_layer=flops["per_layer"],
        seconds_per_token_per_layer=t_layer_token, comm_per_layer_row=f["comm_per_layer_row"],
        smallest_tp_that_fits=f["smallest_tp"], verdict=tp_verdict(f), rows=f["rows"])


def assumptions(h: dict) -> list:
    from dflash_nb.parallel import ASSUMED_LINKS
    return [
        "bf16 target weights; per rank = split parameters / tp + the parameters that stay whole, split or "
        "whole as measured here per parameter (layer index aside) on the tiny targets of the same code, or "
        "transformers' plan where no tiny target has the parameter (the MoE experts and router)",
        "parameter counts from transformers' model classes on the meta device (shapes only)",
        "drafter: 5 layers (4 sliding + 1 full) of the target's width, DrafterConfig.from_target's dimensions; "
        "fp32 master weights + gradients + AdamW m, v = 16 bytes per trainable parameter; the frozen embedding "
        "and lm_head are the target's own at tp 1 and two whole bf16 copies at tp > 1 (plain_copy)",
        f"activations: the H200's drafter step at 512 anchors + target forward at hidden 5120 "
        f"({h['drafter_activations_gb'] + h['target_activations_gb']:.1f} GB, derived as in inputs.derivation), "
        "scaled by hidden / 5120; nothing else (CUDA context, allocator slack) is counted: 80 GB decimal",
        "tp must divide the query and KV heads (check_tp_target); the Gated DeltaNet heads (16 key / 48 value) "
        "divide 8 and are gathered whole anyway",
        "time: the H200's measured seconds per layer per row (Qwen3.6-27B width) per FLOP, applied to each "
        "model's forward FLOPs per token of an average layer (2 x active parameters + 4 x heads x head_dim x "
        "the rows' mean causal context + the Gated DeltaNet recurrence); the same achieved rate on an 80 GB "
        "card; MoE expert routing in transformers' eager code is likely slower than this",
        f"TP traffic per layer and row of {ROW_TOKENS} tokens in bf16: a full-attention/MLP layer 2 all-reduces "
        "of tokens x hidden; a Gated DeltaNet layer 1 all-reduce (MLP) + all-gathers of its 4 input "
        "projections' and out_proj's outputs; ring cost 2(n-1)/n (all-reduce), (n-1)/n (all-gather) of the "
        f"bytes over assumed links {ASSUMED_LINKS} (bus bandwidth GB/s, latency s per collective; "
        "not measured here; bench/gpu_check.sh's tp step measures a pair's); no overlap with compute",
        "per micro-step a TP group runs every member's row (tp forwards, each split tp ways), so a rank's "
        "target time per own token is layers x (t_layer + tp x comm): tp changes memory and traffic, not "
        "the ideal throughput; dp = 8 / tp groups, all 8 ranks train the drafter on their own rows",
        "hours per epoch: 1.87e9 tokens over 8 ranks, the feature forward running L - 2 layers; "
        "'with drafter' adds the H200's drafter step at 512 anchors per 4096-token row, scaled by drafter "
        "parameters, serially (one GPU holds both; the pipeline measured 0.86 of serial on one H200)",
    ]


def project(measured: dict) -> dict:
    "Per-rank memory, the smallest tp that fits, traffic and hours per epoch for the three real targets."
    from dflash_nb.parallel import layer_flops_per_token
    h = h200_inputs()
    q36 = real_models()["Qwen3.6-27B"]["config"]
    ref = layer_flops_per_token(q36, h["mean_context"])["per_layer"]
    sec_per_flop = h["per_layer_s_per_row"] / h["row_tokens"] / ref   # per FLOP: the H200's measured rate
    models = {name: project_model(m, measured[m["measured"]], h, sec_per_flop) for name, m in real_models().items()}
    return dict(projected=True, inputs=h, card_gb=CARD_GB, gpus=GPUS, epoch_tokens=EPOCH_TOKENS,
                row_tokens=ROW_TOKENS, seconds_per_flop_h200=sec_per_flop, models=models, assumptions=assumptions(h))


def print_tables(measured: dict, proj: dict):
    print("\nmeasured (CPU, gloo, fp32, 2 ranks; ratios tp 2 / tp 1 from this run)")
    print(f"{'arch':<8} {'MiB/rank tp1':>12} {'tp2':>6} {'ratio':>5} {'peakRSS+ tp1':>12} {'tp2':>5} {'ratio':>5} "
          f"{'anon+ tp1':>9} {'tp2':>5} {'fwd s tp1':>9} {'tp2':>6} {'ratio':>5} {'feat err':>8}")
    for arch, c in measured.items():
        p, r, f = c["params_bytes_per_rank"], c["peak_rss_increase_mib"], c["forward_median_s"]
        an = c["anon_increase_mib"]
        print(f"{arch:<8} {p['tp1'] / 2**20:>12.0f} {max(p['tp2']) / 2**20:>6.0f} "
              f"{c['params_ratio_tp2_over_tp1']:>5.2f} "
              f"{max(r['tp1']):>12.0f} {max(r['tp2']):>5.0f} {c['rss_increase_ratio_tp2_over_tp1']:>5.2f} "
              f"{max(an['tp1']):>9.0f} {max(an['tp2']):>5.0f} "
              f"{f['tp1']:>9.3f} {f['tp2']:>6.3f} {c['forward_ratio_tp2_over_tp1']:>5.2f} "
              f"{c['features_max_rel_err']:>8.1e}")
    print("MiB = parameters held per rank; peakRSS+ = peak RSS - RSS before loading; anon+ = anonymous memory after "
          "the forwards - before loading (file-backed pages: the mmap'd checkpoint and libraries, shared page cache)")
    print(f"\nPROJECTED (arithmetic; assumptions in the JSON) on {GPUS} x {CARD_GB} GB, bf16 target, "
          f"{EPOCH_TOKENS / 1e9:.2f}B tokens per epoch")
    print(f"{'model':<16} {'tp':>2} {'dp':>2} {'heads':>5} {'target':>6} {'drafter':>7} {'copies':>6} {'act':>5} "
          f"{'total':>6} {'fits':>4} {'MB/lyr':>6} {'eff NVL':>7} {'eff PCIe':>8} {'h NVL':>6} {'h PCIe':>6} "
          f"{'h+dr NVL':>8}")
    for name, m in proj["models"].items():
        for r in m["rows"]:
            print(f"{name:<16} {r['tp']:>2} {r['dp']:>2} {'ok' if r['heads_divide'] else 'no':>5} "
                  f"{r['target_gb']:>6.1f} {r['drafter_gb']:>7.1f} {r['embed_head_copies_gb']:>6.1f} "
                  f"{r['activations_gb']:>5.1f} {r['total_gb']:>6.1f} {'yes' if r['fits'] else 'no':>4} "
                  f"{r['traffic_mb_per_layer_row']:>6.0f} {r['tp_efficiency_NVLink']:>7.2f} "
                  f"{r['tp_efficiency_PCIe']:>8.2f} {r['target_hours_NVLink']:>6.1f} {r['target_hours_PCIe']:>6.1f} "
                  f"{r['with_drafter_hours_NVLink']:>8.1f}")
        print(f"{'':<16} -> {m['verdict']}")
    print("GB decimal; 'act' = activation headroom; MB/lyr = tensor bytes combined per layer per 4096-token row; "
          "eff = compute / (compute + tp x comm); h = target-forward hours per epoch, h+dr with the drafter step")


def environment() -> dict:
    import torch
    import transformers
    return dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                cpu_count=os.cpu_count(), machine=platform.machine())


def run_cpu(a):
    "The default: measure both archs at tp 1 and 2 on CPU, project, write the JSON and print the tables."
    shape = SHAPE
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="target_tp."))
    try:
        root = work / "ckpt"
        save_tp_targets(shape, root)
        runs, measured, status = {}, {}, {}
        for arch in shape["archs"]:
            runs[arch] = {tp: launch(arch, tp, shape, root, work, LAUNCH_TIMEOUT_S, False) for tp in (1, 2)}
            measured[arch] = compare(arch, runs[arch], work)
            status[arch] = {p: v["split"] for p, v in runs[arch][2][0]["held"]["patterns"].items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    proj = project(status)
    out = dict(
        bench="target_tp", created=now_iso(), command="python bench/target_tp.py", environment=environment(),
        note="2 processes on 2 shared CPU cores, OMP_NUM_THREADS=1 each, gloo, fp32: tensor parallelism is not "
             "expected to be faster here (each forward is split two ways, but a TP group runs both members' rows, "
             "and the all-reduces go over loopback TCP); this is a correctness and memory bench. tp 1 = both ranks "
             "hold the whole target (load_target), as dp = 2 would; tp 2 = one TP group (load_target_tp)",
        memory_note="peak RSS (VmHWM) counts file-backed pages too: the safetensors checkpoint is mmap'd, so the "
                    "pages a rank reads stay resident (shared page cache, reclaimable) next to the copies it makes. "
                    "At tp 1 (fp32 checkpoint, fp32 target) the weights stay views of the mapped file (file-backed "
                    "pages grow by about the checkpoint, anonymous ones little); at tp 2 a rank's file-backed pages "
                    "grow by more than its slice (a slice along dim 1 of a row-major weight, o_proj/down_proj, spans "
                    "every page of it) and its anonymous pages by the copies. So on CPU the peak RSS falls far less "
                    "than the parameters held; on a GPU the slices are copied to the device and its memory is what "
                    "halves (the GPU check's step tp records torch.cuda memory). anon = RssAnon after the forwards - "
                    "before loading, file = RssFile likewise",
        shapes=dict(archs=shape["archs"], documents=shape["docs"], warmup=shape["warmup"], repeats=shape["repeats"],
                    dtype=shape["dtype"]),
        measured=measured,
        ranks={arch: {f"tp{tp}": [slim(r) for r in rs] for tp, rs in runs[arch].items()} for arch in runs},
        split_status_tp2={arch: runs[arch][2][0]["held"]["patterns"] for arch in runs},
        projection=proj, wall_s=round(time.perf_counter() - t0, 1))
    write_json(a.out, out)
    print_tables(measured, proj)
    print(f"\nwrote {os.path.relpath(a.out)} in {out['wall_s']} s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / "target_tp.json"))
    return run_cpu(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
