"""Decode speed of the CPU engine, side by side in one run: its own forward (``lean``, the default; ``--bf16``
adds it in bfloat16), the same with torch's matmuls only (``-torch``: ``--decode-kernel torch``, no gemv.c),
HF's ``model()`` inside the same engine (``hf``), HF ``generate`` on a static batch, and llama.cpp on the same
weights for each ``--gguf`` given (``pip install llama-cpp-python`` for the benchmark only; its source carries
``convert_hf_to_gguf.py`` to make F32/BF16 GGUFs from the HF directory).

Each engine variant is a real engine server process (``slime_server.rollout.engine_server``, as deployed:
one engine per process), driven over HTTP ``/generate`` with ``c`` concurrent requests; HF and llama.cpp
run in this process. Greedy, EOS ignored, prefill excluded: each rate is (tokens of an N-token run - tokens
of a 1-token run) / (time of the N-token run - time of the 1-token run), best of ``--repeats``, the variants
interleaved per repeat so machine noise hits all of them.

``serve`` is the engine as ``slime-server serve --model M --num-engines 1`` starts it with its defaults
(its threads, its cores: server/core_share.py), driven through its sgl-router; the other engine variants are
started directly with ``--threads``. ``--isa avx2`` (or ``generic``) reruns the whole benchmark under that
instruction-set cap (``rollout/gemv.isa_env``: gemv.c's build, oneDNN, ATen and MKL in every process), so an
AVX-512 machine measures what an AVX2-only one gets; ``--llama-cpp-dir`` puts a llama-cpp-python built for that
cap first on the path (``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"``).

    python tools/bench_decode.py --model smollm2 --levels 1,8,32 --new-tokens 64 --bf16 \
        [--gguf model-f32.gguf --gguf model-bf16.gguf] [--isa avx2 --llama-cpp-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from slime_server.rollout import gemv
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group, python_module_cmd, spawn

_ISA_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512bw", "avx512vl", "amx_bf16", "asimd", "sve"}


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def engine_run(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(len(prompts)) as pool:
        def one(p: list[int]) -> None:
            client.post(f"{url}/generate", json={**body, "input_ids": p}).raise_for_status()

        t0 = time.perf_counter()
        list(pool.map(one, prompts))  # sent together: decoded as one batch
        return time.perf_counter() - t0


@contextlib.contextmanager
def engine_server(path: str, forward: str, dtype: str, kernel: str, threads: int, max_running: int, log_dir: str
                  ) -> Iterator[str]:
    """One engine server process as ``serve`` starts them (its own process, ``threads`` torch threads)."""
    port = find_free_port()
    cmd = python_module_cmd("slime_server.rollout.engine_server", "--model-path", path, "--port", str(port),
                            "--num-threads", str(threads), "--forward", forward, "--dtype", dtype,
                            "--decode-kernel", kernel,
                            "--prefix-cache-mb", "0", "--max-running-requests", str(max_running))
    proc = spawn(cmd, env={"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"},
                 log_path=f"{log_dir}/engine-{forward}-{dtype}-{kernel}.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=300, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_group(proc)


@contextlib.contextmanager
def served_engine(path: str, log_dir: str) -> Iterator[str]:
    """``slime-server serve`` with its defaults and one engine; its sgl-router's URL once it serves."""
    cmd = [str(Path(sys.executable).with_name("slime-server")), "serve", "--model", path, "--num-engines", "1",
           "--port", "0", "--log-dir", f"{log_dir}/serve", "--db-path", f"{log_dir}/serve.db",
           "--trainer-work-dir", f"{log_dir}/jobs"]
    log_path = Path(log_dir) / "serve.log"
    proc = spawn(cmd, env={"TOKENIZERS_PARALLELISM": "false"}, log_path=str(log_path))
    try:
        deadline = time.monotonic() + 600
        while "openai_base_url:" not in (text := log_path.read_text() if log_path.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start (exit {proc.poll()}):\n{text[-4000:]}")
            time.sleep(0.5)
        yield next(line.split()[-1] for line in text.splitlines() if line.startswith("router_url:"))
    finally:
        kill_group(proc, timeout=60)


def hf_run(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def llamacpp_run(llm: Any, prompt: list[int], new_tokens: int) -> float:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    for _ in range(new_tokens):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    return time.perf_counter() - t0


def decode_rate(run: Any, n_seqs: int, new_tokens: int) -> float:
    """0 when the N-token run was not slower than the 1-token run (noise from outside: a sample to drop)."""
    full, one = run(new_tokens), run(1)
    return n_seqs * (new_tokens - 1) / (full - one) if full > one else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | an HF directory")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also the lean engine in bfloat16")
    ap.add_argument("--gguf", action="append", default=[], help="llama.cpp model of the same weights (batch 1 "
                    "only; repeat for F32 and BF16: a file named *bf16* is compared with the bf16 engine)")
    ap.add_argument("--no-serve", action="store_true", help="leave out the engine as serve starts it")
    ap.add_argument("--isa", choices=["native", "avx512", "avx2", "generic"], default=None,
                    help="cap every process's instruction set (rerun under rollout/gemv.isa_env)")
    ap.add_argument("--llama-cpp-dir", default=None, help="import llama_cpp from here (a build for the --isa)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.isa and os.environ.get(gemv.ISA_ENV) != args.isa:  # torch reads its caps once, at start: start again
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **gemv.isa_env(args.isa)})
    if args.llama_cpp_dir:
        sys.path.insert(0, args.llama_cpp_dir)
    print(f"cpu: {_cpu_name()}; flags: {' '.join(sorted(f for f in gemv.cpu_flags() if f in _ISA_FLAGS))}; "
          f"cap {gemv.requested_isa()}: gemv.c built for {gemv.target()}, oneDNN {os.environ.get('ONEDNN_MAX_CPU_ISA', 'any')}, "
          f"ATen {torch.backends.cpu.get_cpu_capability()}", flush=True)
    from transformers import AutoModelForCausalLM

    from slime_server.server.launch import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    levels = [int(x) for x in args.levels.split(",")]
    kinds = {"lean": ("lean", "float32", "c"), "lean-torch": ("lean", "float32", "torch"),
             "hf": ("hf", "float32", "torch"), "lean-bf16": ("lean", "bfloat16", "c"),
             "lean-bf16-torch": ("lean", "bfloat16", "torch")}
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(engine_server(path, fwd, dtype, kernel, args.threads, max(levels), logs))
                for name, (fwd, dtype, kernel) in kinds.items() if "bf16" not in name or args.bf16}
        if not args.no_serve:
            urls = {"serve": stack.enter_context(served_engine(path, logs)), **urls}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        llms: dict[str, Any] = {}
        for gguf in args.gguf:
            from llama_cpp import Llama

            llms[Path(gguf).stem] = Llama(model_path=gguf, n_threads=args.threads, verbose=False, logits_all=False,
                                          n_ctx=args.prompt_len + args.new_tokens + 8)
        for c in levels:
            prompts = _prompts(vocab, c, args.prompt_len, seed=c)
            variants: dict[str, Any] = {f"engine-{name} c={c}": lambda n, u=url, p=prompts: engine_run(u, p, n)
                                        for name, url in urls.items()}
            variants[f"hf-static c={c}"] = lambda n, p=prompts: hf_run(hf, p, n)
            if c == 1:
                for name, llm in llms.items():
                    variants[f"llama.cpp {name} c={c}"] = lambda n, m=llm, p=prompts[0]: llamacpp_run(m, p, n)
            for run in variants.values():
                run(2)  # warm up
            for _ in range(args.repeats):
                for name, run in variants.items():
                    best[name] = max(best.get(name, 0.0), decode_rate(run, c, args.new_tokens))
            for name in variants:
                print(f"{name:<28} {best[name]:8.1f} tok/s", flush=True)
            base = best[f"hf-static c={c}"]
            ratios = [f"{v} / HF static = {best[f'engine-{v} c={c}'] / base:.2f}x" for v in urls]
            ratios += [f"{v} / {m} = {best[f'engine-{v} c={c}'] / best[f'llama.cpp {m} c={c}']:.2f}x"
                       for v in urls if v != "hf" for m in llms if c == 1 and ("bf16" in v) == ("bf16" in m.lower())]
            print(f"c={c}: " + ", ".join(ratios), flush=True)
        if len(levels) > 1:
            for v in urls:
                print(f"{v} c={levels[-1]} / c={levels[0]} = "
                      f"{best[f'engine-{v} c={levels[-1]}'] / best[f'engine-{v} c={levels[0]}']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(best, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
