"""Random-weight targets of Qwen3.6-27B's width: the library's `tiny_target`, built on the device (no download)."""
from __future__ import annotations

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
DENSE_KEYS = (   # the Qwen3 (every layer full attention) stack of the same width
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def _on_device(arch, dev, dims, layers, dtype):
    "`tiny_target` (seed 0) built directly on `dev` (no host copy of billions of weights); pad/eos ids fit any vocab."
    import torch
    from dflash_nb.target import tiny_target
    with torch.device(dev):
        return tiny_target(arch, num_layers=layers, full_attention_interval=4, dtype=dtype, pad_token_id=0,
                           eos_token_id=1, **dims)


def hybrid_target(dev, dims, layers, dtype):
    "A random-weight Qwen3.5/3.6-architecture CausalLM (3 Gated DeltaNet layers per full-attention one) on `dev`."
    return _on_device("qwen3_5", dev, dims, layers, dtype)


def dense_target(dev, dims, layers, dtype):
    "A random-weight Qwen3-architecture CausalLM (every layer full attention) of the same width, built on `dev`."
    return _on_device("qwen3", dev, {k: dims[k] for k in DENSE_KEYS}, layers, dtype)


def spread_ids(last, n=5):
    "n layer ids spread over [0, last], ending at `last` (so the feature forward runs layers 0..last)."
    return sorted({int(round(i * last / (n - 1))) for i in range(n)})
