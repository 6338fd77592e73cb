"""The decode step's matmuls in C (gemv.c), built for this machine on first use.

Why: a decode step's matmuls multiply every weight once by a few rows, so they run at the speed the weights
stream in, and torch's fp32 kernels stream them at 17 (MKL) to 31 (oneDNN) GB/s on the 2-core AMD EPYC the
benchmarks ran on where this loop reaches ~40; the RMSNorm before a matmul, the SiLU-and-multiply before the
down projection and the residual add after one are folded in (each was a torch call per layer, and in bf16
a conversion each). ``tools/bench_decode.py`` measures the engine end to end.

The source is compiled once per machine with the system C compiler (``cc -O3 -march=native -fopenmp``,
~0.3 s) into the cache (``$SLIME_SERVER_CACHE`` or ``~/.cache/slime-server``, ``kernels/``), keyed by the
source, the compiler and the CPU's flags; it links ``libgomp.so.1``, which in a process that imported torch
is torch's own OpenMP runtime (one soname, loaded once), so its threads are torch's. Without a compiler,
AVX-512, or (bf16) AVX512-BF16, ``load()`` says why once and the engine keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("gemv.c")
MAX_ROWS = 16  # rows of x up to which the kernel beats torch's GEMM (decode batches; prompts stay on torch)
PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL = 0, 1, 2  # gemv.c's pre-ops
_ARGS = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
         + [ctypes.c_void_p] * 2 + [ctypes.c_int])
_SYMBOLS = {torch.float32: "slime_gemv_f32", torch.bfloat16: "slime_gemv_bf16"}


def cache_dir() -> Path:
    root = os.environ.get("SLIME_SERVER_CACHE") or os.path.join(Path.home(), ".cache", "slime-server")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / f"gemv-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(out),
                        "-lm"], check=True, capture_output=True, text=True, timeout=300)
        os.replace(out, target)  # atomic: engines starting together each build, one file wins
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None (logged once) when it cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (cc): the CPU engine's decode matmuls stay on torch's kernels")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("building gemv.c failed (%s): the CPU engine's decode matmuls stay on torch's kernels", detail)
        return None
    for name in _SYMBOLS.values():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = _ARGS, ctypes.c_int
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Gemv:
    """``y = resid + (pre(x) @ weight.T + bias)`` for 2-D ``x`` of at most MAX_ROWS rows, in one dtype.

    ``norm`` (a [k] weight) makes pre RMSNorm with ``eps``; ``silu_mul`` makes it silu(gate) * up with ``x``
    [m, 2k] = gate | up; ``resid`` [m, n] is added last. ``weight``'s rows must be contiguous (its row
    stride may be wider: views into a fused tensor are read in place)."""

    def __init__(self, fn: ctypes._CFuncPtr, dtype: torch.dtype) -> None:
        self._fn, self.dtype = fn, dtype

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
                 resid: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        n, k = weight.shape
        if x.shape[1] != (2 * k if silu_mul else k) or weight.stride(1) != 1 or x.dtype != self.dtype:
            raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)}")
        resid = None if resid is None else resid.contiguous()
        y = torch.empty((m, n), dtype=self.dtype)
        pre = PRE_RMSNORM if norm is not None else PRE_SILU_MUL if silu_mul else PRE_NONE
        if self._fn(weight.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, weight.stride(0), pre, _ptr(norm), eps,
                    _ptr(bias), _ptr(resid), torch.get_num_threads()):
            raise MemoryError("gemv: no memory for the pre-op's rows")
        return y


def kernel(dtype: torch.dtype) -> Gemv | None:
    """The kernel for ``dtype`` (float32 or bfloat16), or None where this machine's build has none."""
    lib = load()
    name = _SYMBOLS.get(dtype)
    fn = getattr(lib, name, None) if lib is not None and name else None
    return None if fn is None else Gemv(fn, dtype)
