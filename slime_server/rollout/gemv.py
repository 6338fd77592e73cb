"""The decode step's matmuls in C (gemv.c), built for this machine on first use.

Why: a decode step's matmuls multiply every weight once by a few rows, so they run at the speed the weights
stream in, and torch's fp32 kernels stream them slower than this loop; the RMSNorm before a matmul, the
SiLU-and-multiply before the down projection and the residual add after one are folded in (each was a torch
call per layer, and in bf16 a conversion each). ``tools/bench_decode.py`` measures the engine end to end.

One portable source (GCC/Clang vector extensions) compiled for the host with the system C compiler (``cc -O3
-march=native -fopenmp``, ~0.3 s): AVX-512, AVX2+FMA, NEON or plain SSE2 each get their own register width
from the compiler, rather than a hand-written path per ISA that only the developer's CPU would test. It is
built once per machine into the cache (``$SLIME_SERVER_CACHE`` or ``~/.cache/slime-server``, ``kernels/``),
keyed by the source, the compiler, its flags and the CPU's flags; it links ``libgomp.so.1``, which in a
process that imported torch is torch's own OpenMP runtime (one soname, loaded once), so its threads are
torch's. Without a compiler ``load()`` says why once and the engine keeps torch's ops.

``SLIME_CPU_ISA`` caps the instruction set (``native``, the default; ``avx512``; ``avx2``; ``generic``, the
architecture's baseline), so an AVX-512 machine measures and tests what an AVX2-only one gets; ``isa_env``
gives a process the same cap for torch's own kernels (oneDNN, ATen, MKL).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Literal, get_args

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("gemv.c")
MAX_ROWS = 16  # rows of x up to which the kernel beats torch's GEMM (decode batches; prompts stay on torch)
PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL = 0, 1, 2  # gemv.c's pre-ops
_ARGS = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
         + [ctypes.c_void_p] * 2 + [ctypes.c_int])
_SYMBOLS = {torch.float32: "slime_gemv_f32", torch.bfloat16: "slime_gemv_bf16"}
_LORA_ARGS = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
              + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])
Isa = Literal["native", "avx512", "avx2", "generic"]
ISA_ENV = "SLIME_CPU_ISA"
# what each cap needs from an x86 CPU (a build for more than the CPU has would die on its first instruction)
_NEEDS = {"avx512": ("avx512f",), "avx2": ("avx2", "fma")}
# torch's own kernels under the same cap: oneDNN's matmuls, ATen's vectorised ops, MKL
_TORCH_CAPS = {"avx512": {}, "native": {},
               "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
               "generic": {"ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default",
                           "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}


class IsaError(ValueError):
    """An instruction-set cap this machine cannot run."""


def cache_dir() -> Path:
    root = os.environ.get("SLIME_SERVER_CACHE") or os.path.join(Path.home(), ".cache", "slime-server")
    return Path(root) / "kernels"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86: /proc/cpuinfo's ``flags``; ARM: ``Features``), empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def requested_isa() -> Isa:
    """The cap from ``SLIME_CPU_ISA`` (default ``native``); an unknown name is an error, not ignored."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in get_args(Isa):
        raise IsaError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(get_args(Isa))}")
    return isa  # type: ignore[return-value]


def runnable_isas() -> list[Isa]:
    """The caps this machine can build and run: ``native`` and ``generic`` always, AVX-512 and AVX2 where the
    CPU has them (an AVX-512 machine runs the AVX2 build too)."""
    flags = cpu_flags()
    forced = [isa for isa, need in _NEEDS.items() if is_x86() and all(f in flags for f in need)]
    return ["native", *forced, "generic"]  # type: ignore[list-item]


def isa_env(isa: Isa) -> dict[str, str]:
    """Environment that caps a process at ``isa``: gemv.c's build and torch's kernels (set before torch loads)."""
    return {ISA_ENV: isa, **_TORCH_CAPS[isa]}


def _compile_flags(isa: Isa) -> list[list[str]]:
    """Flag sets to try, best first, for ``isa`` on this machine."""
    if isa in _NEEDS:
        missing = [f for f in _NEEDS[isa] if not is_x86() or f not in cpu_flags()]
        if missing:
            raise IsaError(f"{ISA_ENV}={isa}: this CPU lacks {', '.join(missing)}")
    if isa == "generic":
        return [[]]
    if isa == "avx2":
        return [["-march=native", "-mno-avx512f"]]
    return [["-march=native"], ["-mcpu=native"], []]  # -mcpu: older clang on ARM; then the baseline


def _build(compiler: str, flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(flags).encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    target = cache_dir() / f"gemv-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, "-O3", *flags, "-shared", "-fPIC", str(SOURCE), "-o", str(out), "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(out, target)  # atomic: engines starting together each build, one file wins
    return target


@functools.cache
def load(isa: Isa | None = None) -> ctypes.CDLL | None:
    """The library built for ``isa`` (default: ``SLIME_CPU_ISA``), or None (logged once) when this machine has
    no C compiler. Raises ``IsaError`` for a cap the CPU cannot run."""
    isa = isa or requested_isa()
    attempts = [[*f, "-fopenmp"] for f in _compile_flags(isa)]
    attempts.append(attempts[-1][:-1])  # a compiler without OpenMP (Apple's clang): one thread, still vectorised
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (cc): the CPU engine's decode matmuls stay on torch's kernels")
        return None
    errors = []
    for flags in attempts:
        try:
            lib = ctypes.CDLL(str(_build(compiler, flags)))
            break
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{' '.join(flags)}: {getattr(e, 'stderr', '') or e}")
    else:
        log.warning("building gemv.c failed (%s): the CPU engine's decode matmuls stay on torch's kernels",
                    "; ".join(errors))
        return None
    if "-fopenmp" not in flags:
        log.warning("gemv.c built without OpenMP (%s): its matmuls run on one thread", compiler)
    lib.slime_gemv_target.restype = ctypes.c_char_p
    for name in _SYMBOLS.values():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGS, ctypes.c_int
    lib.slime_lora_f32.argtypes, lib.slime_lora_f32.restype = _LORA_ARGS, ctypes.c_int
    return lib


def target(isa: Isa | None = None) -> str | None:
    """What the build for ``isa`` was compiled for (``avx512+bf16``, ``avx512``, ``avx2``, ``avx``, ``neon``,
    ``generic``), None without a build."""
    lib = load(isa)
    return None if lib is None else lib.slime_gemv_target().decode()


def solo_macs(wait_policy: str | None) -> int:
    """Multiply-adds below which a call runs on one thread rather than torch's team, for OpenMP's wait policy.

    Why: each call is an OpenMP parallel region. With ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep between regions:
    what a process sharing its cores wants, and what the test suite runs with) waking the team is a futex round
    trip, ~40-50 us of CPU per call, while a decode step's matmuls on a small model take 10-100 us alone: on a
    2-core AMD EPYC (``tools/bench_gemv_threads.py``, 2026-11-29) two threads were no faster in wall time than one
    up to ~3M multiply-adds (the tiny model's every matmul; SmolLM2's at one row but its logits) and cost 1.3-6x
    the CPU. Spinning threads (the default policy, or active) wake at once: there the team was faster at every
    size measured, so it always runs."""
    return 4_000_000 if (wait_policy or "").strip().lower() == "passive" else 0


# read once, as libgomp reads its environment once (at torch's import)
SOLO_MACS = solo_macs(os.environ.get("OMP_WAIT_POLICY"))


def threads_for(macs: int) -> int:
    """The threads a call of ``macs`` multiply-adds runs on (``SOLO_MACS``)."""
    return 1 if macs < SOLO_MACS else torch.get_num_threads()


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
                    _ptr(bias), _ptr(resid), threads_for(m * n * k)):
            raise MemoryError("gemv: no memory for the pre-op's rows")
        return y


def kernel(dtype: torch.dtype, isa: Isa | None = None) -> Gemv | None:
    """The kernel for ``dtype`` (float32 or bfloat16) built for ``isa``, or None (no compiler, another dtype)."""
    lib = load(isa)
    name = _SYMBOLS.get(dtype)
    fn = getattr(lib, name, None) if lib is not None and name else None
    return None if fn is None else Gemv(fn, dtype)


class LoraDeltas:
    """A decode batch's LoRA deltas in place, each row through its own adapter slot (gemv.c's ``slime_lora_f32``):
    ``y[i] += Bt[s]ᵀ-parts (A[s] x[i])`` for rows whose ``slots[i]`` > 0, fp32. ``a`` [slots, rp, k]; ``bts`` one
    [slots, r, out_p] per part, their outputs side by side in ``y`` [m, Σ out_p] (contiguous rows)."""

    def __init__(self, fn: ctypes._CFuncPtr) -> None:
        self._fn = fn

    def __call__(self, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                 bts: list[torch.Tensor]) -> None:
        x = x.contiguous()
        m, k = x.shape
        outs = [b.shape[2] for b in bts]
        if (a.shape[2] != k or y.shape != (m, sum(outs)) or y.stride(1) != 1 or slots.dtype != torch.int64
                or any(t.dtype != torch.float32 or not t.is_contiguous() for t in (x, a, *bts))):
            raise ValueError(f"lora: x {tuple(x.shape)}, a {tuple(a.shape)}, y {tuple(y.shape)} do not fit")
        parts = len(bts)
        macs = m * (a.shape[1] * k + bts[0].shape[1] * y.shape[1])  # A x, then r rows of B per output
        self._fn(x.data_ptr(), m, k, slots.data_ptr(), a.data_ptr(), a.shape[1], parts,
                 (ctypes.c_int64 * parts)(*[b.data_ptr() for b in bts]), (ctypes.c_int64 * parts)(*outs),
                 bts[0].shape[1], y.data_ptr(), y.stride(0), threads_for(macs))


def lora_kernel(isa: Isa | None = None) -> LoraDeltas | None:
    """The LoRA delta kernel built for ``isa``, or None (no compiler)."""
    lib = load(isa)
    return None if lib is None else LoraDeltas(lib.slime_lora_f32)


def main(argv: list[str] | None = None) -> int:
    """``python -m slime_server.rollout.gemv``: what this machine builds; ``--env ISA``: the caps as ``K=V``."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--env", choices=get_args(Isa), help="print the environment that caps a process at ISA")
    args = ap.parse_args(argv)
    if args.env:
        if args.env not in runnable_isas():
            raise SystemExit(f"error: this CPU cannot run {args.env} (it can: {', '.join(runnable_isas())})")
        print(" ".join(f"{k}={v}" for k, v in isa_env(args.env).items()))
        return 0
    isa = requested_isa()
    print(f"{ISA_ENV}={isa}: gemv.c built for {target(isa)} (this CPU runs: {', '.join(runnable_isas())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
