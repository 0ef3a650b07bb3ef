"""Fused anchor-block attention in Triton (installed as `dflash_nb.kernels`).

Importing this package does not build any kernel: the Triton functions are created on first use, in
interpreter mode for CPU tensors (or when TRITON_INTERPRET=1) and compiled for CUDA tensors."""
from .anchor_attention import (CONFIGS, LAUNCHED, SMEM_LIMIT, TileConfig, anchor_block_attention_triton,
                               compile_for_target, compiled_smem, interpret_requested, override_configs, pick_config,
                               ptxas_stats)

__all__ = ["anchor_block_attention_triton", "TileConfig", "CONFIGS", "SMEM_LIMIT", "LAUNCHED", "pick_config",
           "override_configs", "compile_for_target", "compiled_smem", "ptxas_stats", "interpret_requested"]
