"""Random-weight targets of Qwen3.6-27B's width, built on the device from a config (no weights are downloaded)."""
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

