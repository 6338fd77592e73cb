"""Benchmark the bucketed weight push against a plain memcpy of the same bytes.

    python tools/bench_weight_sync.py                       # ~257 MB Qwen3-shaped model, real engine
    python tools/bench_weight_sync.py --sizes 64 512 --repeats 5 --json out.json

What is timed, per transport and bucket size: ``WeightPusher.push`` end to end into a real CPU engine
process (``slime_server.rollout.engine_server`` serving a Qwen3 checkpoint of the same shapes), through
SGLang's routes: pause, every bucket packed into a reusable buffer and either handed over as a shared-memory
tensor (``tensor``: ``/update_weights_from_tensor``) or broadcast over a gloo group (``distributed``:
``/update_weights_from_distributed``), the engine loading each bucket into its live parameters, continue,
and the version check.
``--sources``: where the pushed tensors come from. ``trainer``: what a sender rank pushes, the export of a
Megatron-core model (TP = 1) whose parameters are in shared memory, q/k/v split out of Megatron's fused layout
into shared staging buffers (``weights.SharedStaging``), as ``TrainerRank.push_weights`` does. ``shared``: in shared memory, as a trainer rank's parameters are
before a same-host push (``weights.share_in_place``): the tensor path hands them over in place and the engine
copies straight from them. ``plain``: ordinary tensors (what a conversion produces, e.g. TP-gathered or q/k/v
split out of Megatron's layout): packed into a bucket first. The broadcast path packs both.

Baseline, measured in the same round: torch ``copy_`` of the same tensors into one preallocated,
already-touched buffer (one memcpy of the bytes). The push makes at least two copies (into the bucket,
then into the engine's parameters), so 50% of memcpy is the ceiling a copy-bound push of plain tensors can
reach; from shared tensors it makes one.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from pydantic import BaseModel

from slime_server.trainer.convert import iter_hf_tensors
from slime_server.trainer.weight_push import WeightPusher
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group, python_module_cmd, spawn
from slime_server.weights import SharedStaging, share_in_place

MiB = 2**20


class BenchRow(BaseModel):
    mode: str
    source: str
    bucket_mib: int
    buckets: int
    push_s: float
    push_gbps: float
    pack_s: float
    memcpy_s: float
    memcpy_gbps: float
    ratio: float


class BenchReport(BaseModel):
    model_bytes: int
    tensors: int
    threads: int
    rows: list[BenchRow]


def bench_config(layers: int, hidden: int, vocab: int):
    """A Qwen3 config with real model shapes (GQA, gated MLP, qk-norm), sized by the arguments."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                       head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096)


def save_checkpoint(config, out: Path, tokenizer_from: Path) -> dict[str, torch.Tensor]:
    """Save a random checkpoint the engine can serve; returns its state dict (names, shapes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out))
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def new_weights(state: dict[str, torch.Tensor], seed: int) -> list[tuple[str, torch.Tensor]]:
    """Fresh random tensors with the checkpoint's names and shapes (the trainer's "next version")."""
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(t.shape, generator=gen, dtype=torch.float32)) for n, t in state.items()]


def memcpy_seconds(named: list[tuple[str, torch.Tensor]], dst: torch.Tensor) -> float:
    """One copy of every tensor into its slot of a preallocated flat buffer."""
    t0 = time.perf_counter()
    off = 0
    for _, t in named:
        n = t.numel()
        dst[off:off + n].view(t.shape).copy_(t)
        off += n
    return time.perf_counter() - t0


def megatron_model(hf_dir: Path) -> torch.nn.Module:
    """The checkpoint as the trainer holds it (a Megatron-core GPTModel, TP = 1, this process), its parameters in
    shared memory, as a sender rank's are before a same-host push."""
    from transformers import AutoConfig

    from slime_server.trainer.convert import load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model
    from slime_server.trainer.parallel import init_parallel

    init_parallel(tp_size=1)
    model = build_gpt_model(AutoConfig.from_pretrained(str(hf_dir))).eval()
    load_hf_checkpoint_into(model, hf_dir)
    share_in_place(p.data for p in model.parameters())
    return model


def run(args: argparse.Namespace) -> BenchReport:
    from slime_server.models.tiny import ensure_tiny_model

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    try:
        state = save_checkpoint(bench_config(args.layers, args.hidden, args.vocab), workdir, ensure_tiny_model())
        named = new_weights(state, seed=1)
        total = sum(t.numel() * t.element_size() for _, t in named)
        print(f"model: {len(named)} tensors, {total / 1e6:.1f} MB fp32; engine threads={args.threads}", flush=True)
        dst = torch.empty(sum(t.numel() for _, t in named), dtype=torch.float32)
        dst.zero_()  # touch every page, so the baseline is a pure copy
        port = find_free_port()
        cmd = python_module_cmd("slime_server.rollout.engine_server", "--model-path", str(workdir),
                                "--port", str(port), "--num-threads", str(args.threads))
        proc = spawn(cmd, env={"OMP_NUM_THREADS": str(args.threads)}, log_path=str(workdir / "engine.log"))
        url = f"http://127.0.0.1:{port}"
        rows: list[BenchRow] = []
        try:
            wait_http_ok(f"{url}/health", timeout=300, proc=proc)
            version = 0
            shared = [(n, t.clone()) for n, t in named]
            share_in_place(t for _, t in shared)
            trainer = megatron_model(workdir) if "trainer" in args.sources else None
            staging = SharedStaging()  # what the rank's export converts (q/k/v) is written into shared buffers
            cases = [(m, src, s) for src in args.sources for m in args.modes for s in args.sizes]
            for mode, source, mib in cases:
                tensors = {"shared": shared, "plain": named}.get(source)
                pushes, memcpys, packs, n_buckets = [], [], [], 0
                with WeightPusher([url], bucket_bytes=mib * MiB, mode=mode, sender=True) as p:
                    for _ in range(args.warmup + args.repeats):
                        version += 1
                        stats = p.push(iter(tensors) if tensors is not None else iter_hf_tensors(trainer, staging), version)
                        mc = memcpy_seconds(named, dst)
                        pushes.append(stats.seconds)
                        packs.append(stats.pack_seconds)
                        memcpys.append(mc)
                        n_buckets = stats.buckets
                push_s = statistics.median(pushes[args.warmup:])
                mc_s = statistics.median(memcpys[args.warmup:])
                row = BenchRow(mode=mode, source=source, bucket_mib=mib, buckets=n_buckets, push_s=push_s, push_gbps=total / 1e9 / push_s,
                               pack_s=statistics.median(packs[args.warmup:]), memcpy_s=mc_s,
                               memcpy_gbps=total / 1e9 / mc_s, ratio=mc_s / push_s)
                rows.append(row)
                print(f"{mode:11s} {source:6s} bucket {mib:4d} MiB  buckets {row.buckets:3d}  push {row.push_s * 1e3:7.1f} ms "
                      f"{row.push_gbps:6.2f} GB/s (pack {row.pack_s * 1e3:6.1f} ms)  memcpy "
                      f"{row.memcpy_s * 1e3:6.1f} ms {row.memcpy_gbps:6.2f} GB/s  ratio {row.ratio:5.1%}", flush=True)
        finally:
            kill_group(proc)
        return BenchReport(model_bytes=total, tensors=len(named), threads=args.threads, rows=rows)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 128, 256, 512], help="bucket sizes, MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", nargs="+", choices=["tensor", "distributed"], default=["tensor", "distributed"])
    ap.add_argument("--sources", nargs="+", choices=["trainer", "shared", "plain"],
                    default=["trainer", "shared", "plain"],
                    help="a Megatron model's export (parameters in shared memory, q/k/v converted), tensors in "
                         "shared memory, or plain tensors")
    ap.add_argument("--threads", type=int, default=1, help="torch threads here and in the engine")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    if args.json:
        args.json.write_text(report.model_dump_json(indent=2))
    for mode, source in [(m, src) for src in args.sources for m in args.modes]:
        rows = [r for r in report.rows if r.mode == mode and r.source == source]
        print(f"{mode} {source}: best {max(r.push_gbps for r in rows):.2f} GB/s, ratio push/memcpy "
              f"{min(r.ratio for r in rows):.1%}..{max(r.ratio for r in rows):.1%} "
              f"(targets: tensor >= 50% of memcpy, distributed >= 1 GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
