"""Speculative decoding on a hybrid target: the snapshot cache against the recompute reference, at 1K and 4K context.

A hybrid target's linear-attention (Gated DeltaNet) state cannot be cropped after a rejection. `cache="recompute"`
reruns the whole sequence at every verification; `cache="snapshot"` saves the linear layers' conv and recurrent states
before each verification, restores them after a rejection and feeds only the anchor and the accepted drafts again.

Target: tiny_target("qwen3_5") with the Qwen3.6-27B layer pattern (every 4th layer full attention, the others Gated
DeltaNet), 8 layers, hidden 64, fp32, on CPU (transformers' reference PyTorch kernels). Block size 16 (the flagship
drafter's). Prompts: fixed random token ids of 1024 and 4096 tokens; 64 generated tokens each (greedy).
Proposers (cheap, so the timing is the target's):
  * "prefix": a drafter forced to the target's own greedy text for a pseudo-random 0..15 slots per cycle, then wrong
    (ForcedProposer mode "prefix"; τ = 12.6 here, more than most trained drafters reach at B = 16);
  * "wrong": every draft rejected (τ = 1): a rollback and a second forward every cycle, the snapshot path's worst case.
Measured per context, proposer and mode: target tokens processed per committed token (prefill excluded), target
forwards, wall time (the prefill, timed separately, subtracted), and whether the tokens equal the recompute run's and
plain greedy decoding's. The ratio is recompute / snapshot wall time, both measured in the same run.
Done when: snapshot's target tokens per committed token are flat from 1K to 4K, and every output is identical.

Run: .venv/bin/python bench/eval_cache.py [--quick]   (writes bench/results/eval_cache.json; --quick: 256/1024 tokens)
"""
import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from _common import write_json

from dflash_nb.decoding import ForcedProposer, greedy_generate, speculative_generate
from dflash_nb.target import tiny_target

B, N_NEW, LAYERS, LAYER_IDS = 16, 64, 8, [1, 4, 6]
OUT = Path(__file__).resolve().parent / "results" / "eval_cache.json"


def prefill_seconds(model, prompt) -> float:
    "Wall time of the prompt's forward with a cache (what both modes pay once before the first cycle)."
    from transformers import DynamicCache
    t = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=prompt[None], use_cache=True, logits_to_keep=1, **{"cache": DynamicCache(config=model.config)})
    return time.perf_counter() - t


def run_context(model, n_ctx: int) -> dict:
    "Both proposers, both modes, on one prompt of `n_ctx` tokens."
    prompt = torch.randint(1000, 100_000, (n_ctx,), generator=torch.Generator().manual_seed(n_ctx))
    greedy = greedy_generate(model, prompt, N_NEW)["tokens"]
    ref = torch.cat([prompt, greedy])
    t_prefill = prefill_seconds(model, prompt)
    out = dict(context=n_ctx, prefill_s=round(t_prefill, 4), proposers={})
    for mode_name in ("prefix", "wrong"):
        runs = {}
        for cache in ("snapshot", "recompute"):
            proposer = ForcedProposer([ref], B, mode_name)
            r = speculative_generate(proposer, model, prompt, N_NEW, B, LAYER_IDS, cache=cache)
            committed = r["tokens"].numel() - 1  # the prefill's token is not a cycle's
            decode_s = max(r["seconds"] - t_prefill, 1e-9)
            runs[cache] = dict(tau=round(r["tau"], 3), cycles=len(r["accept_lengths"]), forwards=r["forwards"],
                               target_tokens_per_committed=round((r["target_tokens"] - n_ctx) / committed, 3),
                               seconds=round(r["seconds"], 3), decode_ms_per_token=round(1e3 * decode_s / committed, 2),
                               tokens=r["tokens"], accept_lengths=r["accept_lengths"])
        s, c = runs["snapshot"], runs["recompute"]
        s_tokens = s.pop("tokens")
        same = torch.equal(s_tokens, c.pop("tokens")) and s["accept_lengths"] == c["accept_lengths"]
        out["proposers"][mode_name] = dict(
            snapshot={k: v for k, v in s.items() if k != "accept_lengths"},
            recompute={k: v for k, v in c.items() if k != "accept_lengths"},
            identical_to_recompute=same, identical_to_greedy=torch.equal(s_tokens, greedy),
            wall_ratio_recompute_over_snapshot=round(c["seconds"] / s["seconds"], 2),
            decode_ratio_recompute_over_snapshot=round(c["decode_ms_per_token"] / s["decode_ms_per_token"], 2))
        p = out["proposers"][mode_name]
        tok_s, tok_c = s["target_tokens_per_committed"], c["target_tokens_per_committed"]
        print(f"{n_ctx:>5} ctx  {mode_name:<6}  τ {s['tau']:.2f}  target tokens / committed: snapshot {tok_s:.1f}, "
              f"recompute {tok_c:.1f}  |  decode ms / token: snapshot {s['decode_ms_per_token']:.1f}, "
              f"recompute {c['decode_ms_per_token']:.1f} ({p['decode_ratio_recompute_over_snapshot']:.1f}x; "
              f"whole call {p['wall_ratio_recompute_over_snapshot']:.1f}x)  "
              f"identical: {p['identical_to_recompute'] and p['identical_to_greedy']}", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 and 1024 context tokens (a smoke run; JSON not written)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_target("qwen3_5", num_layers=LAYERS, full_attention_interval=4)
    contexts = (256, 1024) if a.quick else (1024, 4096)
    t0 = time.perf_counter()
    results = [run_context(model, n) for n in contexts]
    lo, hi = (r["proposers"] for r in results)
    growth = lambda cache: {m: round(hi[m][cache]["target_tokens_per_committed"]
                                     / lo[m][cache]["target_tokens_per_committed"], 3) for m in lo}
    flat, grow = growth("snapshot"), growth("recompute")
    identical = all(p["identical_to_recompute"] and p["identical_to_greedy"]
                    for r in results for p in r["proposers"].values())
    print(f"target tokens per committed token, {contexts[1]} vs {contexts[0]} context: snapshot x{flat}, "
          f"recompute x{grow}; all outputs identical: {identical}")
    res = dict(block_size=B, new_tokens=N_NEW,
               target=dict(arch="qwen3_5", layers=LAYERS, full_attention_every=4, hidden=64),
               layer_ids=LAYER_IDS, contexts=results, snapshot_cost_growth=flat, recompute_cost_growth=grow,
               all_identical=identical, seconds=round(time.perf_counter() - t0, 1), torch=torch.__version__,
               threads=torch.get_num_threads(), machine=platform.machine(),
               note="CPU shared with other jobs while measured: wall times are inflated, token counts are exact")
    if not a.quick:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        write_json(OUT, res, indent=2)
        print(f"wrote {OUT}")
    return 0 if identical and max(flat.values()) < 1.25 else 1


if __name__ == "__main__":
    sys.exit(main())
