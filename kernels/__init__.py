"""Fused anchor-block attention in Triton (installed as `dflash_nb.kernels`)."""
