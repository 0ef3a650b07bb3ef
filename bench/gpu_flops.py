"""FLOP accounting of the GPU check: the bf16 peak by device, the useful FLOPs of the target's feature forward.

Useful work only: padding and masked-out pairs are not counted, so a faster path that skips them shows as more
TFLOP/s, never as more FLOPs. The drafter's attention is counted in bench/attention.py (`useful_flops`).
"""
from __future__ import annotations

FULL_TARGET_LAYERS = 64        # Qwen3.6-27B
FULL_TARGET_RUN_LAYERS = 62    # the drafter taps layers [1, 16, 31, 46, 61]: the feature forward stops after layer 61

# dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device name; --peak-tflops overrides (or gives an unknown one)
PEAK_BF16_TFLOPS = {"H200": 989, "H100": 989, "H800": 989, "H20": 148, "GH200": 989, "B200": 2250, "B100": 1750,
                    "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "L4": 121, "A10G": 70, "RTX 4090": 165}

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

