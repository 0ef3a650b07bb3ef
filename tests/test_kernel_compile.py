"""Every tile config of the kernel compiles for Hopper (sm_90) and SM120 Blackwell (sm_120) and fits SM120's shared
memory. No GPU needed: Triton's wheel ships ptxas, so `triton.compile` with an explicit GPUTarget runs on the CPU
and the compiled metadata reports the shared memory the launch will request. This also checks the compiled (non-
interpreter) code path, which the CPU correctness tests in test_kernel.py cannot reach."""
import pytest
import torch

from dflash_nb.kernels.anchor_attention import CONFIGS, SMEM_LIMIT, TileConfig, compile_for_target, compiled_smem, ptxas_stats

TABLE = [(d, esize, kind) for (d, esize), kinds in CONFIGS.items() for kind in kinds]


@pytest.mark.parametrize("capability", [90, 120], ids=["sm90", "sm120"])
@pytest.mark.parametrize("d,esize,kind", TABLE, ids=[f"d{d}-{'fp32' if e == 4 else 'bf16'}-{k}" for d, e, k in TABLE])
def test_config_fits_sm120(d, esize, kind, capability):
    """Shared memory within SM120's limit; for the 16-bit training configs also (almost) no register spills, the
    criterion the table was chosen by (a kernel edit that makes them spill should revisit the table)."""
    dtype = torch.float32 if esize == 4 else torch.bfloat16
    compiled = compile_for_target(kind, d, dtype, capability)
    shared = compiled.metadata.shared
    assert 0 < shared <= SMEM_LIMIT, f"{kind} d={d} {dtype}: {shared} bytes > {SMEM_LIMIT}"
    if esize == 2:
        stats = ptxas_stats(compiled, capability)
        assert stats["spill_bytes"] is not None and stats["spill_bytes"] <= 64, stats


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_variants_compile(kind):
    "In-block causality, a non-power-of-two block size (padded tile rows) and fp16 also compile within the limit."
    for kw in (dict(causal=True), dict(block_size=10), dict(dtype=torch.float16)):
        args = dict(dtype=torch.bfloat16, capability=120)
        args.update(kw)
        assert compiled_smem(kind, 128, **args) <= SMEM_LIMIT


def test_limit_is_enforced():
    "The measurement is real: an oversized tile is reported above the SM120 limit."
    big = TileConfig(128, 128, 8, 3)
    assert compiled_smem("fwd", 256, torch.bfloat16, 90, cfg=big) > SMEM_LIMIT


def test_compile_is_specialised_like_a_launch():
    """The AOT compile carries the launch-time specialisation (16-byte aligned pointers and strides), so the kv loop
    is software-pipelined with cp.async just as on the GPU; without it shared memory would be under-reported."""
    compiled = compile_for_target("fwd", 128, torch.bfloat16, 90)
    assert "async_copy" in compiled.asm["ttgir"]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_preprocess_compiles(d):
    "The delta = rowsum(dO * O) kernel compiles for both targets without spilling."
    for cap in (90, 120):
        compiled = compile_for_target("pre", d, torch.bfloat16, cap)
        assert compiled.metadata.shared <= SMEM_LIMIT
        assert ptxas_stats(compiled, cap)["spill_bytes"] == 0


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_launch_shape_checked_at_compile_time(kind):
    "Each kernel runs the one shared set of compile-time checks: 8 kv columns per tile is refused before any codegen."
    from triton.compiler.errors import CompilationError
    with pytest.raises(CompilationError) as e:
        compile_for_target(kind, 64, torch.bfloat16, 90, cfg=TileConfig(32, 8, 4, 1))
    assert "tl.dot needs a multiple of 16 columns" in repr(e.value) + repr(e.value.__cause__)
