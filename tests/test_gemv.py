"""The decode step's C matrix-vector kernels (rollout/gemv.c) against float64, within the rounding bound of
their arithmetic: fp32 sums of k products err by at most gamma_k = k*u/(1-k*u) times sum |w*x| (u = 2^-24);
bf16 products are exact in fp32, the same bound holds for their fp32 sums, and the final rounding to bf16
adds at most 2^-8 of the result (bf16 keeps 8 significant bits). Shapes cover the blocked rows (8), the 4-row passes over x, the tails of
both, and rows that are views into a wider tensor (the fused QKV and gate/up weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_server.rollout import gemv

U32 = 2.0**-24
HAS_AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text()
HAS_BF16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
SHAPES = [(1, 960, 576), (2, 13, 40), (3, 8, 16), (4, 64, 100), (5, 1024, 577), (8, 3072, 576), (16, 24, 1536)]


def test_the_kernels_are_built_where_the_cpu_has_them() -> None:
    """This machine (and CI's) has a C compiler and AVX-512 (with BF16): both kernels must build and load;
    elsewhere the kernel is absent and the engine keeps torch's matmuls."""
    assert (gemv.kernel(torch.float32) is not None) == HAS_AVX512
    assert (gemv.kernel(torch.bfloat16) is not None) == (HAS_AVX512 and HAS_BF16)
    assert gemv.kernel(torch.float16) is None


def _check(dtype: torch.dtype, m: int, n: int, k: int, strided: bool, bias: bool) -> None:
    linear = gemv.kernel(dtype)
    assert linear is not None
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    wide = torch.randn(n + 5, k + (9 if strided else 0), generator=g).to(dtype)
    w = wide[2:n + 2, :k]  # rows at a stride wider than k when strided
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = linear(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    w64, x64 = w.double(), x.double()
    exact = x64 @ w64.T
    gamma = k * U32 / (1 - k * U32)
    bound = gamma * (x64.abs() @ w64.abs().T)
    if dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    if b is not None:  # the bias is added by torch after the kernel: one more rounding of the sum
        exact = exact + b.double()
        y_ref_tol = (2.0**-8 if dtype == torch.bfloat16 else U32) * exact.abs()
        bound = bound * (1 + 2.0**-8) + y_ref_tol
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_fp32_kernel_is_within_the_rounding_bound(m: int, n: int, k: int, strided: bool) -> None:
    if not HAS_AVX512:
        assert gemv.kernel(torch.float32) is None
        return
    _check(torch.float32, m, n, k, strided, bias=m == 3)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_bf16_kernel_is_within_the_rounding_bound(m: int, n: int, k: int, strided: bool) -> None:
    if not (HAS_AVX512 and HAS_BF16):
        assert gemv.kernel(torch.bfloat16) is None
        return
    _check(torch.bfloat16, m, n, k, strided, bias=m == 3)


def test_the_build_is_cached_per_source_compiler_and_cpu(tmp_path: Path, monkeypatch) -> None:
    """A second load reuses the library built by the first (no compile per engine start)."""
    if not HAS_AVX512:
        return
    monkeypatch.setenv("SLIME_SERVER_CACHE", str(tmp_path))
    gemv.load.cache_clear()
    try:
        assert gemv.load() is not None
        built = sorted((tmp_path / "kernels").glob("gemv-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        gemv.load.cache_clear()
        assert gemv.load() is not None
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("gemv-*.so")] == [stamp]
    finally:
        gemv.load.cache_clear()
