"""Padding waste of the target forward: length-bucketed padded micro-batches (the old path) vs one packed, unpadded
forward per row (TargetFeatures' packed path), on a thinking-trace length mix.

Length mix: 20,000 samples, lognormal with mean ~2,000 tokens (sigma 0.8), clipped to [32, 8192] (a long tail to 8,192;
~1.5% hit the clip), packed into rows of 4,096 tokens exactly as the trainer packs them (RowStream: shuffled, then
dflash_nb.anchors.pack_samples; a sample longer than a row is cut to the row).
Counted per row (pure arithmetic, no model):
  * tokens computed: padded = sum over micro-batches of n_docs x longest doc (bucket_spans, max_batch_tokens=16384,
    the trainer's default); packed = the row's real tokens (padding is dropped before the forward);
  * attention score pairs: padded = sum n_docs x longest^2; packed with sdpa and a block-diagonal mask = T^2 (the mask
    hides but does not skip the cross-document pairs); packed with varlen kernels (flash_attention_2, fla) = sum n_i^2.
    Useful pairs = sum n_i^2. (Causality halves every count alike.)
Timed (if --time, default on): one tiny Qwen3 target (hidden 128, 4 layers) on CPU, features of layers [1, 2], padded vs
packed over the first rows, min of 2 repeats; the shared 2-core box inflates both alike, the ratio is what counts.

Run: .venv/bin/python bench/target_packing.py   (writes bench/results/target_packing.json)
"""
import argparse
import json
import math
import platform
import random
import time
from pathlib import Path

import torch

from dflash_nb.anchors import make_packed_row
from dflash_nb.target import TargetFeatures, bucket_spans, document_spans, tiny_target
from dflash_nb.rows import RowStream

ROW, MAX_BATCH_TOKENS, MAX_LEN = 4096, 16384, 8192


def length_mix(n: int, mean: float = 2000.0, sigma: float = 0.8, seed: int = 0) -> list[int]:
    "Thinking-trace lengths: lognormal with the given mean, clipped to [32, MAX_LEN]."
    rng = random.Random(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    return [min(MAX_LEN, max(32, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def row_costs(doc_lengths: list[int]) -> dict:
    "Tokens and attention pairs one row costs on each path."
    starts = [0]
    for n in doc_lengths: starts.append(starts[-1] + n)
    spans = list(zip(starts[:-1], starts[1:]))
    buckets = bucket_spans(spans, MAX_BATCH_TOKENS)
    longest = [max(e - s for s, e in b) for b in buckets]
    real = sum(doc_lengths)
    return dict(real=real, padded=sum(len(b) * L for b, L in zip(buckets, longest)), packed=real,
                pairs_useful=sum(n * n for n in doc_lengths),
                pairs_padded=sum(len(b) * L * L for b, L in zip(buckets, longest)),
                pairs_packed_mask=real * real, micro_batches=len(buckets))


def timed(fn, repeats: int = 2) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--time-rows", type=int, default=4, help="rows timed on the tiny CPU target (0: no timing)")
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
                    padded_waste=tot["padded"] / tot["real"] - 1, packed_waste=tot["packed"] / tot["real"] - 1),
        attention_pairs=dict(padded_over_useful=tot["pairs_padded"] / tot["pairs_useful"],
                             packed_sdpa_mask_over_useful=tot["pairs_packed_mask"] / tot["pairs_useful"],
                             packed_varlen_over_useful=1.0),
        micro_batches_per_row=tot["micro_batches"] / len(rows), platform=platform.platform(), torch=torch.__version__)
    if args.time_rows:
        torch.manual_seed(0)
        model = tiny_target("qwen3", hidden_size=128, num_layers=4, intermediate_size=384, vocab_size=4096,
                            pad_token_id=0, eos_token_id=1)
        packed, padded = TargetFeatures(model, [1, 2]), TargetFeatures(model, [1, 2], packing="padded")
        samples = [{"input_ids": torch.randint(2, 4096, (min(lengths[i], ROW),)).tolist(),
                    "loss_mask": [1] * min(lengths[i], ROW)} for r in rows[:args.time_rows] for i in r]
        batch, k = [], 0
        for r in rows[:args.time_rows]:
            batch.append(make_packed_row(samples[k:k + len(r)], ROW))
            k += len(r)
        run = lambda tf: [tf(b["input_ids"], b["doc_ids"]) for b in batch]
        for b in batch:   # the two paths agree (fp32 round-off) before anything is timed
            torch.testing.assert_close(packed(b["input_ids"], b["doc_ids"]), padded(b["input_ids"], b["doc_ids"]),
                                       rtol=1e-4, atol=1e-4)
        t_pad, t_pack = timed(lambda: run(padded)), timed(lambda: run(packed))
        res["cpu_time"] = dict(rows=len(batch), padded_s=t_pad, packed_s=t_pack, padded_over_packed=t_pad / t_pack,
                               target="tiny qwen3 hidden 128, 4 layers, sdpa, fp32", threads=torch.get_num_threads())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    t = res["tokens"]
    st = res["setup"]
    print(f"{len(rows)} rows of {ROW}, {st['docs_per_row']:.2f} docs/row, fill {st['row_fill']:.3f}")
    print(f"tokens computed / real: padded buckets {1 + t['padded_waste']:.4f} (waste {t['padded_waste']:.1%}), "
          f"packed {1 + t['packed_waste']:.4f} (waste {t['packed_waste']:.1%})")
    a = res["attention_pairs"]
    print(f"attention pairs / useful: padded {a['padded_over_useful']:.2f}, packed+sdpa mask "
          f"{a['packed_sdpa_mask_over_useful']:.2f}, packed varlen 1.00")
    if "cpu_time" in res:
        c = res["cpu_time"]
        print(f"CPU time, {c['rows']} rows: padded {c['padded_s']:.2f} s, packed {c['packed_s']:.2f} s "
              f"(padded / packed = {c['padded_over_packed']:.2f})")
    return res


if __name__ == "__main__":
    main()
