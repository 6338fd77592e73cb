"""The decode step's C kernels (rollout/gemv.c) against float64, within the rounding bound of their
arithmetic. A sum of k products in fp32 errs by at most gamma_k = k*u/(1-k*u) times sum |w*x| (u = 2^-24);
bf16 products are exact in fp32, so the same bound holds for their fp32 sums, and every rounding to bf16
(8 significant bits) adds at most 2^-8 of its value. The folded-in ops add their own roundings: RMSNorm
(a sum of k squares, a square root, two products), silu(gate) * up (exp within 2 ulp, a sum, a quotient, a
product), the bias and the residual (one sum each). Shapes cover the blocked rows (4 or 8), the 2- or 3-row
passes over x, the tails of both, and rows that are views into a wider tensor (the fused QKV and gate/up
weights). Each instruction set this machine can run is built and checked: its own (``native``), AVX-512
and AVX2 where the CPU has them, and the architecture's baseline (``generic``: SSE2 on x86, NEON on ARM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_server.rollout import gemv

U32 = 2.0**-24
U16 = 2.0**-8
ISAS = gemv.runnable_isas()
SHAPES = [(1, 960, 576), (2, 13, 40), (3, 8, 16), (4, 64, 100), (5, 1024, 577), (8, 3072, 576), (16, 24, 1536)]
EPS = 1e-5


def test_every_cpu_gets_a_kernel_for_both_dtypes() -> None:
    """With a C compiler (CI installs one) both kernels build on any CPU, each for what it was asked for."""
    expected = {"avx512": "avx512", "avx2": "avx2", "generic": "neon" if not gemv.is_x86() else "generic"}
    for isa in ISAS:
        assert gemv.kernel(torch.float32, isa) is not None and gemv.kernel(torch.bfloat16, isa) is not None
        if isa in expected:
            assert gemv.target(isa).split("+")[0] == expected[isa]
    assert gemv.kernel(torch.float16) is None


def test_a_cap_the_cpu_cannot_run_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(gemv.ISA_ENV, "avx1024")
    with pytest.raises(gemv.IsaError, match="expected one of"):
        gemv.requested_isa()
    if "avx512" not in ISAS:
        with pytest.raises(gemv.IsaError, match="lacks avx512f"):
            gemv.load("avx512")


def test_the_cap_reaches_torch_kernels_too() -> None:
    """A forced AVX2 process caps oneDNN and ATen as well (what an AVX2-only machine runs end to end)."""
    env = gemv.isa_env("avx2")
    assert env == {"SLIME_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


def _check(isa: str, dtype: torch.dtype, m: int, n: int, k: int, strided: bool, pre: str, bias: bool,
           resid: bool) -> None:
    kernel = gemv.kernel(dtype, isa)
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
@pytest.mark.parametrize("isa", ISAS)
def test_the_kernel_is_within_the_rounding_bound(isa: str, dtype: torch.dtype, m: int, n: int, k: int,
                                                 strided: bool) -> None:
    """Every shape with every fold-in: none, bias, RMSNorm, RMSNorm + bias (QKV with qwen2's bias), SiLU-mul
    + residual (the down projection), residual, bias + residual (o_proj with a bias)."""
    for pre, bias, resid in CASES:
        _check(isa, dtype, m, n, k, strided, pre, bias, resid)


@pytest.mark.parametrize("isa", ISAS)
def test_the_kernel_equals_torch_on_a_models_shapes(isa: str) -> None:
    """SmolLM2's decode matmuls (576 wide, 1536 MLP) against torch's own fp32 ops, within 1e-5."""
    kernel = gemv.kernel(torch.float32, isa)
    g = torch.Generator().manual_seed(5)
    for m, n, k in [(1, 1728, 576), (8, 576, 1536), (3, 3072, 576)]:
        x, w, r = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(m, n, generator=g)
        torch.testing.assert_close(kernel(x, w, resid=r), r + x @ w.T, rtol=1e-5, atol=1e-5)
        norm = torch.rand(k, generator=g) + 0.5
        torch.testing.assert_close(kernel(x, w, norm=norm, eps=EPS),
                                   torch.nn.functional.rms_norm(x, (k,), norm, EPS) @ w.T, rtol=1e-5, atol=1e-5)
        gu = torch.randn(m, 2 * k, generator=g)
        torch.testing.assert_close(kernel(gu, w, silu_mul=True),
                                   (torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]) @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_thread_count_gives_the_same_bits(dtype: torch.dtype, monkeypatch) -> None:
    """Threads split the rows into runs (gemv.c's thread_rows): a row's arithmetic must not depend on which
    thread takes it, nor on threads left without a block (fewer blocks than threads), nor on the prefetch of
    the next block that more rows of x than one pass turn on. Every call here runs on the team (no solo
    threshold), small ones included."""
    monkeypatch.setattr(gemv, "SOLO_MACS", 0)
    kernel = gemv.kernel(dtype)
    g = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    try:
        for m, n, k in [(1, 8, 64), (2, 24, 64), (8, 960, 576), (5, 1029, 577)]:
            x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
            r, norm = torch.randn(m, n, generator=g).to(dtype), (torch.rand(k, generator=g) + 0.5).to(dtype)
            results = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                results.append(kernel(x, w, norm=norm, eps=EPS, resid=r))
            for y in results[1:]:
                assert torch.equal(y, results[0]), (m, n, k)
    finally:
        torch.set_num_threads(before)


def test_small_calls_run_on_one_thread_where_waking_the_team_costs_more(monkeypatch) -> None:
    """Below SOLO_MACS multiply-adds a call runs on one thread; the threshold follows OpenMP's wait policy (sleeping
    threads cost a wake-up per call: passive has one, spinning threads none); at or above it, torch's thread count."""
    assert gemv.solo_macs("PASSIVE") == gemv.solo_macs("passive") > 0 == gemv.solo_macs(None) == gemv.solo_macs("ACTIVE")
    before = torch.get_num_threads()
    monkeypatch.setattr(gemv, "SOLO_MACS", 1000)
    try:
        torch.set_num_threads(2)
        assert [gemv.threads_for(macs) for macs in (1, 999, 1000, 10**9)] == [1, 1, 2, 2]
    finally:
        torch.set_num_threads(before)


def test_a_shape_that_does_not_fit_is_refused() -> None:
    kernel = gemv.kernel(torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.zeros(1, 7), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.zeros(1, 8), torch.zeros(4, 8), silu_mul=True)  # silu_mul wants gate | up: 16 columns


def test_the_build_is_cached_per_source_compiler_and_cpu(tmp_path: Path, monkeypatch) -> None:
    """A second load reuses the library built by the first (no compile per engine start)."""
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


@pytest.mark.parametrize("isa", ISAS)
def test_the_lora_kernel_equals_torch(isa: str, monkeypatch) -> None:
    """gemv.c's batched LoRA deltas (issue 43): every row through its own adapter slot, slot 0 left alone, equal to
    torch's matmuls per row to 1e-5 (relative to the delta's size); fused qkv-like parts and a lone projection; each
    thread count gives the same bits."""
    monkeypatch.setattr(gemv, "SOLO_MACS", 0)  # each thread count as asked
    kernel = gemv.lora_kernel(isa)
    gen = torch.Generator().manual_seed(0)
    for parts, k in (((576, 192, 192), 576), ((576,), 1536)):
        r, slots_n = 16, 4
        a = torch.randn(slots_n, len(parts) * r, k, generator=gen) / k ** 0.5
        bts = [torch.randn(slots_n, r, n, generator=gen) for n in parts]
        x = torch.randn(7, k, generator=gen)
        slots = torch.tensor([0, 1, 2, 3, 1, 0, 3])
        base = torch.randn(7, sum(parts), generator=gen)
        want = base.clone()
        for i, s in enumerate(slots.tolist()):
            if s:
                h = a[s] @ x[i]
                want[i] += torch.cat([h[p * r:(p + 1) * r] @ bts[p][s] for p in range(len(parts))])
        outs, prev = [], torch.get_num_threads()
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                got = base.clone()
                kernel(got, x, slots, a, bts)
                outs.append(got)
        finally:
            torch.set_num_threads(prev)
        scale = float((want - base).abs().max())
        assert torch.equal(outs[0][slots == 0], base[slots == 0])
        torch.testing.assert_close(outs[0], want, atol=1e-5 * scale, rtol=0)
        assert all(torch.equal(o, outs[0]) for o in outs[1:])
