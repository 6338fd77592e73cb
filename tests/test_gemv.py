"""The decode step's C kernels (rollout/gemv.c) against float64, within the rounding bound of their
arithmetic. A sum of k products in fp32 errs by at most gamma_k = k*u/(1-k*u) times sum |w*x| (u = 2^-24);
bf16 products are exact in fp32, so the same bound holds for their fp32 sums, and every rounding to bf16
(8 significant bits) adds at most 2^-8 of its value. The folded-in ops add their own roundings: RMSNorm
(a sum of k squares, a square root, two products), silu(gate) * up (exp within 2 ulp, a sum, a quotient, a
product), the bias and the residual (one sum each). Shapes cover the blocked rows (8), the 3-row passes over
x, the tails of both, and rows that are views into a wider tensor (the fused QKV and gate/up weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_server.rollout import gemv

U32 = 2.0**-24
U16 = 2.0**-8
FLAGS = Path("/proc/cpuinfo").read_text()
HAS_AVX512 = "avx512f" in FLAGS
HAS_BF16 = "avx512_bf16" in FLAGS
SHAPES = [(1, 960, 576), (2, 13, 40), (3, 8, 16), (4, 64, 100), (5, 1024, 577), (8, 3072, 576), (16, 24, 1536)]
EPS = 1e-5


def test_the_kernels_are_built_where_the_cpu_has_them() -> None:
    """This machine (and CI's) has a C compiler and AVX-512 (with BF16): both kernels must build and load;
    elsewhere the kernel is absent and the engine keeps torch's ops."""
    assert (gemv.kernel(torch.float32) is not None) == HAS_AVX512
    assert (gemv.kernel(torch.bfloat16) is not None) == (HAS_AVX512 and HAS_BF16)
    assert gemv.kernel(torch.float16) is None


def _gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


def _check(dtype: torch.dtype, m: int, n: int, k: int, strided: bool, pre: str, bias: bool, resid: bool) -> None:
    kernel = gemv.kernel(dtype)
    assert kernel is not None
    u = U16 if dtype == torch.bfloat16 else U32  # the unit roundoff of each op's result
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    wide = torch.randn(n + 5, k + (9 if strided else 0), generator=g).to(dtype)
    w = wide[2:n + 2, :k]  # rows at a stride wider than k when strided
    x = torch.randn(m, 2 * k if pre == "silu_mul" else k, generator=g).to(dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype) if pre == "norm" else None
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    r = torch.randn(m, n, generator=g).to(dtype) if resid else None
    y = kernel(x, w, b, norm=norm, eps=EPS, silu_mul=pre == "silu_mul", resid=r)
    assert y.shape == (m, n) and y.dtype == dtype

    x64, w64 = x.double(), w.double()
    pre_err = 0.0  # relative error of each element of the kernel's pre(x)
    if pre == "norm":
        x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * norm.double()
        pre_err = _gamma(k) / 2 + 4 * U32 + (U16 if dtype == torch.bfloat16 else 0.0)
    elif pre == "silu_mul":
        gate, up = x64[:, :k], x64[:, k:]
        x64 = gate * torch.sigmoid(gate) * up
        pre_err = 6 * U32 + (2 * U16 if dtype == torch.bfloat16 else 0.0)
    exact = x64 @ w64.T
    bound = (_gamma(k) + pre_err * (1 + _gamma(k))) * (x64.abs() @ w64.abs().T)
    if dtype == torch.bfloat16 or bias:
        if bias:
            exact = exact + b.double()
        bound = bound * (1 + u) + u * exact.abs()  # the matmul's (and bias's) sum rounded to the dtype
    if resid:
        exact = exact + r.double()
        bound = bound * (1 + u) + u * exact.abs()
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


CASES = [("none", False, False), ("none", True, False), ("norm", False, False), ("norm", True, False),
         ("silu_mul", False, True), ("none", False, True), ("none", True, True)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_is_within_the_rounding_bound(dtype: torch.dtype, m: int, n: int, k: int, strided: bool) -> None:
    """Every shape with every fold-in: none, bias, RMSNorm, RMSNorm + bias (QKV with qwen2's bias), SiLU-mul
    + residual (the down projection), residual, bias + residual (o_proj with a bias)."""
    if not HAS_AVX512 or (dtype == torch.bfloat16 and not HAS_BF16):
        assert gemv.kernel(dtype) is None
        return
    for pre, bias, resid in CASES:
        _check(dtype, m, n, k, strided, pre, bias, resid)


def test_a_shape_that_does_not_fit_is_refused() -> None:
    kernel = gemv.kernel(torch.float32)
    if kernel is None:
        return
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.zeros(1, 7), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.zeros(1, 8), torch.zeros(4, 8), silu_mul=True)  # silu_mul wants gate | up: 16 columns


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
