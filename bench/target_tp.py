"""The frozen target split tensor-parallel (chapter 07c_parallel): memory per rank and forward time, tp 2 against tp 1.

    python bench/target_tp.py [--out bench/results/target_tp.json]       # CPU, gloo, fp32 (a few minutes on 2 cores)
    python bench/target_tp.py --gpu-check --out FILE [--deadline-s S] [--dry-run]   # gpu_check.sh's tp step

Measured (CPU, the default): a Qwen3 dense and a Qwen3.5-style hybrid target (`dflash_nb.target.tiny_target`, hidden
1024, saved once with `dflash_nb.parallel.saved_tiny_target`), each loaded in a 2-process torchrun run (gloo,
OMP_NUM_THREADS=1 per rank) twice: whole on every rank (`load_target`, tp 1: what dp = 2 holds) and split over a TP
group of 2 (`load_target_tp`). Per rank: the bytes of parameters it holds (a DTensor's `to_local()` is its slice),
by kind and split vs replicated; its peak RSS and the increase over the RSS before loading; the `TargetFeatures`
forward of one packed row (median after a warm-up; both ranks start each forward together); and the features of the
split target against the whole one. The tp 2 / tp 1 ratios come from the same run. On 2 shared cores tensor
parallelism is not expected to be faster: this is a correctness and memory bench.

Projected (arithmetic, no weights; the library's `dflash_nb.parallel.tp_fit`, chapter 07c_parallel): per-rank memory,
the smallest tp that fits 8 x 80 GB, the TP group's traffic per layer and hours per epoch for Qwen3.6-27B,
Llama-3.3-70B and Qwen3-235B-A22B, with the split/replicated status measured here per parameter and the H200 numbers
in bench/results/gpu_pipeline.json; every assumption is written into the JSON next to the number it makes.

--gpu-check: the same measurement for bench/gpu_check.sh on a machine with >= 2 CUDA devices: NCCL, bf16, the hybrid
at Qwen3.6-27B's width (4 layers, every 2nd full attention; a 32K vocabulary keeps the checkpoint small), plus the
all-reduce bandwidth of the pair; its JSON is the GPU check's step record (gpu_tp.json). With --dry-run: gloo, fp32,
tiny shapes on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import now_iso, sync, write_json   # noqa: E402  (bench/ is on sys.path from here on)
from dflash_nb.parallel import TP_KINDS, is_split, weight_kind, weight_pattern   # noqa: E402

DOCS = {"cpu": [200, 180, 132], "gpu": [1500, 1400, 1196], "dry": [20, 12]}   # document lengths of the packed row
HYBRID_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=12, linear_key_head_dim=64, linear_value_head_dim=64)
COMMON = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64, intermediate_size=3072,
              vocab_size=32768, full_attention_interval=4, pad_token_id=0, eos_token_id=1, seed=0)
SHAPES = {   # (mode) -> what is measured: tiny_target kwargs per arch, the row, warm-up and timed forwards
    "cpu": dict(archs={"qwen3": COMMON, "qwen3_5": {**COMMON, **HYBRID_HEADS}}, docs=DOCS["cpu"], warmup=1,
                repeats=5, dtype="float32", device="cpu"),
    "gpu": dict(archs={"qwen3_5": dict(hidden_size=5120, num_layers=4, num_heads=24, num_kv_heads=4, head_dim=256,
                                       intermediate_size=17408, vocab_size=32768, full_attention_interval=2,
                                       linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                                       linear_value_head_dim=128, pad_token_id=0, eos_token_id=1, seed=0)},
                docs=DOCS["gpu"], warmup=2, repeats=5, dtype="bfloat16", device="cuda"),
    "dry": dict(archs={"qwen3_5": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                                       intermediate_size=128, vocab_size=1024, full_attention_interval=2,
                                       pad_token_id=0, eos_token_id=1, seed=0)},
                docs=DOCS["dry"], warmup=1, repeats=2, dtype="float32", device="cpu"),
}
LAUNCH_TIMEOUT_S = 600


# ---- what a rank holds -----------------------------------------------------------------------------------------------
def held_bytes(model) -> dict:
    "Bytes of parameters this rank holds, by kind, split (DTensor: its local slice) vs replicated; and per pattern."
    kinds = {k: dict(split_local=0, split_whole=0, replicated=0) for k in TP_KINDS}
    patterns = {}
    for name, p in model.named_parameters():
        split = is_split(p)
        local = p.to_local() if split else p
        whole_b, local_b = p.numel() * local.element_size(), local.numel() * local.element_size()
        k = kinds[weight_kind(name)]
        if split:
            k["split_local"] += local_b
            k["split_whole"] += whole_b
        else:
            k["replicated"] += whole_b
        e = patterns.setdefault(weight_pattern(name), dict(kind=weight_kind(name), split=split, whole_numel=0,
                                                           local_numel=0,
                                                           placements=str(getattr(p, "placements", "replicated"))))
        e["whole_numel"] += p.numel()
        e["local_numel"] += local.numel()
    local = sum(k["split_local"] + k["replicated"] for k in kinds.values())
    whole = sum(k["split_whole"] + k["replicated"] for k in kinds.values())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return dict(kinds=kinds, local_bytes=local, whole_bytes=whole, buffer_bytes=buffers, patterns=patterns)


def rss_mib() -> dict:
    "This process's resident set in MiB: now, at its peak, and now split into anonymous and file-backed (mmap) pages."
    names = {"VmRSS:": "now", "VmHWM:": "peak", "RssAnon:": "anon", "RssFile:": "file"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.split()[0] in names:
            out[names[line.split()[0]]] = int(line.split()[1]) / 1024
    return out


# ---- one rank of a 2-process run -------------------------------------------------------------------------------------
def worker(a):
    import datetime
    import torch
    import torch.distributed as dist
    from dflash_nb.parallel import load_target_tp, saved_tiny_target, tp_mesh
    from dflash_nb.target import TargetFeatures, load_target
    from dflash_nb.gpu_target import spread_ids
    spec = json.loads(a.spec)
    cuda = spec["device"] == "cuda"
    if cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    wait = datetime.timedelta(seconds=300)
    if cuda:
        dist.init_process_group("nccl", timeout=wait, device_id=dev)
    else:
        dist.init_process_group("gloo", timeout=wait)
    rank, dtype = dist.get_rank(), getattr(torch, spec["dtype"])
    path = saved_tiny_target(spec["tiny"], dtype, a.root)       # written before the launch: found, every rank waits
    dist.barrier()
    before = rss_mib()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        alloc0 = torch.cuda.memory_allocated(dev)
    t = time.perf_counter()
    if a.tp > 1:
        model = load_target_tp(path, tp_mesh(a.tp, dev.type, 300), dtype, dev)
    else:
        model = load_target(path, dtype=dtype, device=dev)
    load_s = time.perf_counter() - t
    dist.barrier()
    loaded = rss_mib()
    weights_mib = (torch.cuda.memory_allocated(dev) - alloc0) / 2**20 if cuda else None
    held = held_bytes(model)
    ids = spread_ids(spec["tiny"]["num_layers"] - 2)           # the forward runs layers 0 .. L - 2
    tf = TargetFeatures(model, ids)
    g = torch.Generator().manual_seed(0)
    docs = spec["docs"]
    input_ids = torch.randint(2, spec["tiny"]["vocab_size"], (sum(docs),), generator=g)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    times = []
    for _ in range(spec["warmup"] + spec["repeats"]):
        dist.barrier()                                         # both ranks start together: the same contention
        sync(dev)
        t = time.perf_counter()
        feats = tf(input_ids, doc_ids)
        sync(dev)
        times.append(time.perf_counter() - t)
    end = rss_mib()
    out = dict(rank=rank, tp=a.tp, arch=spec["tiny"].get("arch"), load_s=load_s, packing=tf.packing,
               layers_run=max(ids) + 1, feature_ids=ids, row_tokens=sum(docs), documents=docs,
               forward_s=times[spec["warmup"]:], forward_median_s=statistics.median(times[spec["warmup"]:]),
               rss_mib=dict(before_load=before["now"], peak_before_load=before["peak"], before_load_anon=before.get(
                   "anon"), before_load_file=before.get("file"), after_load=loaded["now"],
                            after_load_anon=loaded.get("anon"), after_load_file=loaded.get("file"),
                            end_anon=end.get("anon"), end_file=end.get("file"), peak=end["peak"]), held=held)
    out["rss_mib"]["peak_increase"] = out["rss_mib"]["peak"] - before["now"]
    if cuda:
        out["cuda_mib"] = dict(weights=weights_mib, peak=(torch.cuda.max_memory_allocated(dev) - alloc0) / 2**20)
    if a.tp > 1 and spec.get("allreduce"):
        out["allreduce"] = allreduce_bandwidth(tp_mesh(a.tp, dev.type, 300).get_group(), sum(docs),
                                               spec["tiny"]["hidden_size"], dtype, dev, a.tp)
    if rank == 0:
        torch.save(feats.float().cpu(), Path(a.work) / f"features-{out['arch']}-tp{a.tp}.pt")
    Path(a.work, f"{out['arch']}-tp{a.tp}-rank{rank}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()


def allreduce_bandwidth(group, tokens, hidden, dtype, dev, n) -> dict:
    "Seconds of one all-reduce of a (tokens, hidden) activation over the TP group; NCCL's bus bandwidth convention."
    import torch
    import torch.distributed as dist
    x = torch.ones(tokens, hidden, dtype=dtype, device=dev)
    times = []
    for _ in range(7):
        dist.barrier(group=group)
        sync(dev)
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync(dev)
        times.append(time.perf_counter() - t)
    s = statistics.median(times[2:])
    size = x.numel() * x.element_size()
    return dict(bytes=size, seconds=s, bus_gb_s=2 * (n - 1) / n * size / s / 1e9,
                convention="bus bandwidth = 2 (n - 1) / n x bytes / seconds (NCCL's busbw for all-reduce)")


# ---- the parent: checkpoints, launches, ratios -----------------------------------------------------------------------
def save_checkpoints(spec_archs: dict, dtype: str, root: str, device: str):
    "Each arch's tiny target saved once under `root` (`saved_tiny_target`), built on `device`."
    import torch
    from dflash_nb.parallel import saved_tiny_target
    with torch.device(device):
        for arch, kw in spec_archs.items():
            saved_tiny_target({"arch": arch, **kw}, getattr(torch, dtype), root)


def launch(arch: str, tp: int, shape: dict, root: Path, work: Path, timeout: float, allreduce: bool) -> list[dict]:
    "One 2-process torchrun run of `worker` for `arch` at `tp`; the two ranks' records."
    spec = dict(tiny={"arch": arch, **shape["archs"][arch]}, docs=shape["docs"], warmup=shape["warmup"],
                repeats=shape["repeats"], dtype=shape["dtype"], device=shape["device"], allreduce=allreduce)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", "--tp", str(tp), "--root", str(root), "--work", str(work), "--spec", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"torchrun {arch} tp {tp} exited {p.returncode}:\n{tail}")
    print(f"[tp] {arch} tp {tp}: 2 ranks in {time.perf_counter() - t:.1f} s", flush=True)
    return [json.loads((work / f"{arch}-tp{tp}-rank{r}.json").read_text()) for r in (0, 1)]


def slim(rank_record: dict) -> dict:
    "A rank's record without its per-parameter list (kept once per arch under split_status_tp2)."
    held = {k: v for k, v in rank_record["held"].items() if k != "patterns"}
    return {**rank_record, "held": held}


def compare(arch: str, runs: dict, work: Path) -> dict:
    "tp 2 against tp 1 for one arch: bytes held, RSS, forward time, features."
    import torch
    one, two = runs[1], runs[2]
    f1, f2 = (torch.load(work / f"features-{arch}-tp{tp}.pt") for tp in (1, 2))
    err = float((f2 - f1).abs().max() / f1.abs().max().clamp_min(1e-30))
    t1 = max(r["forward_median_s"] for r in one)
    t2 = max(r["forward_median_s"] for r in two)
    held1, held2 = one[0]["held"], two[0]["held"]
    shares = {}
    for k in TP_KINDS:
        h = held2["kinds"][k]
        whole = h["split_whole"] + h["replicated"]
        if whole:
            shares[k] = dict(whole_bytes=whole, split_share=h["split_whole"] / whole,
                             local_bytes_tp2=h["split_local"] + h["replicated"],
                             local_over_whole=(h["split_local"] + h["replicated"]) / whole)
    return dict(
        params_bytes_per_rank={"tp1": held1["local_bytes"], "tp2": [r["held"]["local_bytes"] for r in two]},
        params_ratio_tp2_over_tp1=max(r["held"]["local_bytes"] for r in two) / held1["local_bytes"],
        kinds_tp2=shares,
        peak_rss_increase_mib={"tp1": [r["rss_mib"]["peak_increase"] for r in one],
                               "tp2": [r["rss_mib"]["peak_increase"] for r in two]},
        rss_increase_ratio_tp2_over_tp1=max(r["rss_mib"]["peak_increase"] for r in two)
        / max(r["rss_mib"]["peak_increase"] for r in one),
        anon_increase_mib={f"tp{tp}": [r["rss_mib"]["end_anon"] - r["rss_mib"]["before_load_anon"] for r in rs]
                           for tp, rs in runs.items()},
        file_increase_mib={f"tp{tp}": [r["rss_mib"]["end_file"] - r["rss_mib"]["before_load_file"] for r in rs]
                           for tp, rs in runs.items()},
        forward_median_s={"tp1": t1, "tp2": t2}, forward_ratio_tp2_over_tp1=t2 / t1,
        micro_step_target_ratio_tp2_over_tp1=2 * t2 / t1,
        features_max_rel_err=err, packing={"tp1": one[0]["packing"], "tp2": two[0]["packing"]})


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
    shape = SHAPES["cpu"]
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="target_tp."))
    try:
        root = work / "ckpt"
        save_checkpoints(shape["archs"], shape["dtype"], str(root), "cpu")
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
                    "halves (the --gpu-check step records torch.cuda memory). anon = RssAnon after the forwards - "
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


def run_gpu_check(a, rec):
    "gpu_check.sh's tp step: the hybrid at tp 1 and tp 2 on two CUDA devices (or, with --dry-run, on CPU)."
    from dflash_nb.gpu_plan import need
    mode = "dry" if a.dry_run else "gpu"
    shape = SHAPES[mode]
    arch = next(iter(shape["archs"]))
    rec.update(device="cpu (dry run)" if a.dry_run else "cuda", dtype=shape["dtype"],
               target=dict(arch=arch, **shape["archs"][arch]), documents=shape["docs"], runs={})
    work = Path(tempfile.mkdtemp(prefix="gpu_tp."))
    try:
        if not rec.fits("save", need("tp", "save", a.dry_run)):
            return rec.finish("nothing measured: no time to save the target")
        t = time.perf_counter()
        # built in a process of its own (on the GPU: cuda:0), so no worker shares a device or its memory with it
        subprocess.run([sys.executable, __file__, "--save", "--root", str(work / "ckpt"), "--mode", mode],
                       check=True, timeout=max(rec.left(), 1))
        rec["save_s"] = round(time.perf_counter() - t, 1)
        runs = {}
        for tp in (1, 2):
            if not rec.fits(f"tp {tp}", need("tp", "launch", a.dry_run)):
                break
            try:
                runs[tp] = launch(arch, tp, shape, work / "ckpt", work, max(rec.left(), 1), tp > 1)
                rec["runs"][f"tp{tp}"] = [slim(r) for r in runs[tp]]
            except Exception as e:
                rec.error(f"tp {tp}", e)
                break
            rec.save()
        if len(runs) < 2:
            return rec.finish(f"tp 1 and tp 2 not both measured ({sorted(runs)})")
        rec["compare"] = c = compare(arch, runs, work)
        ar = runs[2][0].get("allreduce") or {}
        rec["allreduce"] = ar
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec.finish(f"{arch} tp2/tp1: weights per rank {c['params_ratio_tp2_over_tp1']:.2f}x, forward "
               f"{c['forward_ratio_tp2_over_tp1']:.2f}x ({c['forward_median_s']['tp2']:.3f} vs "
               f"{c['forward_median_s']['tp1']:.3f} s/row), features max rel err {c['features_max_rel_err']:.1e}"
               + (f" | all-reduce {ar['bytes'] / 1e6:.3g} MB: {ar['seconds'] * 1e3:.3g} ms, bus {ar['bus_gb_s']:.3g} "
                  "GB/s" if ar else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / "target_tp.json"))
    ap.add_argument("--gpu-check", action="store_true", help="gpu_check.sh's tp step (two CUDA devices)")
    ap.add_argument("--dry-run", action="store_true", help="with --gpu-check: gloo, fp32, tiny shapes on CPU")
    ap.add_argument("--deadline-s", type=float, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="gpu", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.save:
        shape = SHAPES[a.mode]
        return save_checkpoints(shape["archs"], shape["dtype"], a.root, shape["device"])
    if a.gpu_check:
        from dflash_nb.gpu_plan import Record
        rec = Record("tp", a.out, a.deadline_s, a.dry_run)
        try:
            run_gpu_check(a, rec)
        except BaseException as e:
            rec.error("tp", e)
        return 1 if rec["errors"] else 0
    return run_cpu(a)


if __name__ == "__main__":
    sys.exit(main())
