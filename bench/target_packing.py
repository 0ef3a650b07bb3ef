"""Padding waste of the target forward: length-bucketed padded micro-batches vs one packed, unpadded forward per row
(TargetFeatures' packed path), on a thinking-trace length mix, for a dense and a hybrid (Gated DeltaNet) target; and
the target forward's share of this CPU's bf16 matmul peak.

Length mix: 20,000 samples, lognormal with mean ~2,000 tokens (sigma 0.8), clipped to [32, 8192] (a long tail to 8,192;
~1.5% hit the clip), packed into rows of 4,096 tokens exactly as the trainer packs them (RowStream: shuffled, then
dflash_nb.anchors.pack_samples; a sample longer than a row is cut to the row).
Counted per row (pure arithmetic, no model; the same for dense and hybrid targets: buckets ignore layer kinds):
  * tokens computed: padded = sum over micro-batches of n_docs x longest doc (bucket_spans, max_batch_tokens=16384,
    the trainer's default); packed = the row's real tokens (padding is dropped before the forward);
  * attention score pairs: padded = sum n_docs x longest^2; packed with sdpa and a block-diagonal mask = T^2 (the mask
    hides but does not skip the cross-document pairs); packed with varlen kernels (flash_attention_2, fla) = sum n_i^2.
    Useful pairs = sum n_i^2. (Causality halves every count alike.)
Timed (--time-rows, default 4): padded vs packed feature forwards over the first rows, min of 2 repeats, fp32, for
  * dense: a tiny Qwen3 (hidden 128, 4 layers), features of layers [1, 2];
  * hybrid: a tiny Qwen3.5 (hidden 128, 5 layers: 3 Gated DeltaNet, 1 full attention, 1 Gated DeltaNet, Qwen3.6's
    3:1 pattern), features of layers [1, 3]: packed runs the torch conv and recurrence once per document.
Share of peak (--peak-rows, default 1): first the best of 3 bf16 matmuls (3072^3) gives this CPU's bf16 GFLOP/s; then
one packed bf16 feature forward per row through 4 layers of a wider dense and hybrid target (hidden 1024, Qwen3.6-27B's
shapes scaled by 1/5) is timed and its useful FLOPs (`dflash_nb.gpu_target.FLOP_FORMULA`, the GPU check's) divided
by time and by that peak.
The box is shared: both paths of a comparison run in the same process, minutes apart; the ratios are what counts.

Run: .venv/bin/python bench/target_packing.py   (writes bench/results/target_packing.json)
"""
import argparse
import os
import platform
from pathlib import Path

import torch

from _common import best_seconds, matmul_tflops, write_json
from dflash_nb.rows import RowStream
from dflash_nb.target import TargetFeatures, tiny_target
from dflash_nb.gpu_target import (FLOP_FORMULA, MAX_BATCH_TOKENS, length_mix, make_rows, row_costs,
                                  target_row_flops)

ROW = 4096
TINY = dict(hidden_size=128, intermediate_size=384, vocab_size=4096, pad_token_id=0, eos_token_id=1)
WIDE = dict(hidden_size=1024, intermediate_size=3456, num_heads=8, num_kv_heads=2, head_dim=128, vocab_size=4096,
            pad_token_id=0, eos_token_id=1)
WIDE_GDN = dict(linear_num_key_heads=4, linear_num_value_heads=12, linear_key_head_dim=128, linear_value_head_dim=128)


def hybrid_target(**kw):
    "A Qwen3.5 hybrid with Qwen3.6's pattern: layers 0-2 Gated DeltaNet, 3 full attention, 4 Gated DeltaNet."
    return tiny_target("qwen3_5", num_layers=5, full_attention_interval=4, **kw)


def time_paths(model, layer_ids, batch, what: str) -> dict:
    "Padded vs packed CPU seconds over `batch`, after checking that the two paths agree (fp32 round-off)."
    packed, padded = TargetFeatures(model, layer_ids), TargetFeatures(model, layer_ids, packing="padded")
    assert packed.packing == "packed", packed.packing_reason
    for b in batch:
        torch.testing.assert_close(packed(b["input_ids"], b["doc_ids"]), padded(b["input_ids"], b["doc_ids"]),
                                   rtol=1e-4, atol=1e-4)
    run = lambda tf: [tf(b["input_ids"], b["doc_ids"]) for b in batch]
    t_pad, t_pack = best_seconds(lambda: run(padded), 2), best_seconds(lambda: run(packed), 2)
    return dict(rows=len(batch), padded_s=t_pad, packed_s=t_pack, padded_over_packed=t_pad / t_pack, target=what,
                packed_reason=packed.packing_reason, threads=torch.get_num_threads())


def share_of_peak(model, layer_ids, batch, doc_lengths, peak_gflops: float) -> dict:
    "Useful GFLOP/s of the packed bf16 feature forward over `batch`, and its share of the bf16 matmul peak."
    tf = TargetFeatures(model, layer_ids)
    useful = sum(target_row_flops(model, max(layer_ids), d) for d in doc_lengths)
    tf(batch[0]["input_ids"][:256], batch[0]["doc_ids"][:256])   # warm-up
    secs = best_seconds(lambda: [tf(b["input_ids"], b["doc_ids"]) for b in batch], 2)
    gflops = useful / secs / 1e9
    return dict(rows=len(batch), seconds=secs, useful_gflop=useful / 1e9, useful_gflops=gflops,
                percent_of_bf16_peak=100 * gflops / peak_gflops, packing=tf.packing, packed_reason=tf.packing_reason,
                layers_run=max(layer_ids) + 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--time-rows", type=int, default=4, help="rows timed on the tiny CPU targets (0: no timing)")
    ap.add_argument("--peak-rows", type=int, default=1, help="rows of the share-of-peak forwards (0: not measured)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "target_packing.json"))
    args = ap.parse_args(argv)
    lengths = length_mix(args.samples)
    rows = RowStream(lengths, ROW, seed=0).epoch_rows(0)
    costs = [row_costs([min(lengths[i], ROW) for i in r]) for r in rows]
    tot = {k: sum(c[k] for c in costs) for k in costs[0]}
    res = dict(
        setup=dict(samples=args.samples, row_tokens=ROW, max_batch_tokens=MAX_BATCH_TOKENS,
                   mean_length=sum(lengths) / len(lengths),
                   max_length=max(lengths), rows=len(rows), docs_per_row=sum(map(len, rows)) / len(rows),
                   row_fill=tot["real"] / (len(rows) * ROW)),
        tokens=dict(real=tot["real"], padded=tot["padded"], packed=tot["packed"],
                    padded_waste=tot["padded"] / tot["real"] - 1, packed_waste=tot["packed"] / tot["real"] - 1,
                    applies_to="dense and hybrid targets alike"),
        attention_pairs=dict(padded_over_useful=tot["pairs_padded"] / tot["pairs_useful"],
                             packed_sdpa_mask_over_useful=tot["pairs_packed_mask"] / tot["pairs_useful"],
                             packed_varlen_over_useful=1.0),
        micro_batches_per_row=tot["micro_batches"] / len(rows), platform=platform.platform(), torch=torch.__version__,
        load_average_at_start=os.getloadavg())
    torch.manual_seed(0)
    if args.time_rows:
        timed_rows = rows[:args.time_rows]
        batch = make_rows(lengths, timed_rows, TINY["vocab_size"])
        real = sum(min(lengths[i], ROW) for r in timed_rows for i in r)
        padded = sum(row_costs([min(lengths[i], ROW) for i in r])["padded"] for r in timed_rows)
        res["cpu_time"] = time_paths(tiny_target("qwen3", num_layers=4, **TINY), [1, 2], batch,
                                     "tiny qwen3 hidden 128, 4 layers, sdpa, fp32")
        res["hybrid_cpu_time"] = time_paths(hybrid_target(**TINY), [1, 3], batch,
                                            "tiny qwen3_5 hidden 128, 5 layers (3 linear, 1 full, 1 linear), fp32")
        res["hybrid_cpu_time"].update(tokens_computed_per_real_padded=padded / real,
                                       tokens_computed_per_real_packed=1.0)
    if args.peak_rows:
        peak = matmul_tflops(torch.device("cpu"), 3072, torch.bfloat16, 3) * 1e3   # GFLOP/s
        peak_rows = rows[:args.peak_rows]
        batch = make_rows(lengths, peak_rows, WIDE["vocab_size"], seed=1)
        docs = [[min(lengths[i], ROW) for i in r] for r in peak_rows]
        bf16 = dict(dtype=torch.bfloat16)
        res["bf16_peak"] = dict(matmul="3072^3 bf16, best of 3", gflops=peak, threads=torch.get_num_threads(),
                                flop_formula=FLOP_FORMULA, width=dict(**WIDE, **WIDE_GDN))
        res["bf16_peak"]["dense"] = share_of_peak(tiny_target("qwen3", num_layers=5, **WIDE, **bf16), [1, 3], batch,
                                                  docs, peak)
        res["bf16_peak"]["hybrid"] = share_of_peak(hybrid_target(**WIDE, **WIDE_GDN, **bf16), [1, 3], batch, docs,
                                                   peak)
    res["load_average_at_end"] = os.getloadavg()
    write_json(args.out, res)
    t, st = res["tokens"], res["setup"]
    print(f"{len(rows)} rows of {ROW}, {st['docs_per_row']:.2f} docs/row, fill {st['row_fill']:.3f}")
    print(f"tokens computed / real (dense and hybrid): padded buckets {1 + t['padded_waste']:.4f} "
          f"(waste {t['padded_waste']:.1%}), packed {1 + t['packed_waste']:.4f} (waste {t['packed_waste']:.1%})")
    a = res["attention_pairs"]
    print(f"attention pairs / useful: padded {a['padded_over_useful']:.2f}, packed+sdpa mask "
          f"{a['packed_sdpa_mask_over_useful']:.2f}, packed varlen 1.00")
    for key in ("cpu_time", "hybrid_cpu_time"):
        if key in res:
            c = res[key]
            print(f"CPU time, {c['rows']} rows, {c['target']}: padded {c['padded_s']:.2f} s, "
                  f"packed {c['packed_s']:.2f} s (padded / packed = {c['padded_over_packed']:.2f})")
    if "bf16_peak" in res:
        p = res["bf16_peak"]
        print(f"bf16 matmul peak on this CPU: {p['gflops']:.1f} GFLOP/s ({p['threads']} threads)")
        for kind in ("dense", "hybrid"):
            s = p[kind]
            print(f"  {kind} packed bf16 forward, {s['layers_run']} layers at hidden {WIDE['hidden_size']}: "
                  f"{s['useful_gflops']:.1f} GFLOP/s useful = {s['percent_of_bf16_peak']:.1f}% of peak")
    return res


if __name__ == "__main__":
    main()
