"""Weight-update payloads in SGLang's formats: flattened-bucket layout, payload round trip through shared
memory in another process, the receiver's allow-list, and a >= 200 MB gloo broadcast between two
processes over SGLang's group rendezvous."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from slime_server import weights
from slime_server.utils.net import find_free_port, is_local_host


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("c", torch.randint(0, 9, (4,), generator=g)), ("a", torch.randn(3, 5, generator=g)),
            ("d", torch.randn(2, 2, generator=g).t()), ("b", torch.randn(7, generator=g).to(torch.bfloat16))]


def test_layout_is_sglangs_contiguous_one():
    """Back to back, byte offsets, numel in bytes: what SGLang's FlattenedTensorBucket computes."""
    metas = weights.layout_of(_mixed())
    assert [(m.start_idx, m.end_idx) for m in metas] == [(0, 32), (32, 92), (92, 108), (108, 122)]
    assert [m.numel for m in metas] == [32, 60, 16, 14] and weights.flat_size(metas) == 122


def test_fill_and_unflatten_round_trip_exactly():
    named = _mixed()
    metas = weights.layout_of(named)
    flat = torch.empty(weights.flat_size(metas), dtype=torch.uint8)
    weights.fill_flat(flat, named, metas)
    back = weights.unflatten(flat, metas)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_unflatten_refuses_layouts_outside_the_buffer():
    named = [("w", torch.ones(4))]
    metas = weights.layout_of(named)
    flat = torch.zeros(weights.flat_size(metas), dtype=torch.uint8)
    bad = [weights.FlatMeta(name="w", shape=(8,), dtype=torch.float32, start_idx=0, end_idx=32)]
    with pytest.raises(ValueError, match="inside a 16-byte bucket"):
        weights.unflatten(flat, bad)
    wrong = [weights.FlatMeta(name="w", shape=(4,), dtype=torch.float32, start_idx=0, end_idx=12)]
    with pytest.raises(ValueError):
        weights.unflatten(flat, wrong)
    with pytest.raises(ValueError):
        weights.unflatten(torch.zeros(4), metas)


def test_group_by_bytes_streams_and_keeps_big_tensors_alone():
    sizes = [40, 40, 200, 8, 8]
    groups = list(weights.group_by_bytes(((f"t{i}", torch.zeros(n // 4)) for i, n in enumerate(sizes)), 100))
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    with pytest.raises(ValueError):
        list(weights.group_by_bytes(iter(()), 0))


def test_payload_travels_by_shared_memory_to_another_process(tmp_path):
    """The CPU payload names a shared-memory file: an unrelated process maps it (no bytes in the body)
    and reads exactly the tensors, through the receiver's allow-listed unpickler."""
    named = _mixed()
    payload = weights.serialize_flattened_bucket(named)
    assert len(payload) < 4096  # the body holds names and metadata, not the tensors' bytes
    script = textwrap.dedent(f"""
        import sys, torch
        from slime_server import weights
        named = weights.payload_tensors(weights.load_payload(sys.stdin.read()), "flattened_bucket")
        torch.save({{n: t.clone() for n, t in named}}, {str(tmp_path / "got.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], input=payload, text=True, check=True, timeout=60)
    got = torch.load(tmp_path / "got.pt")
    assert list(got) == [n for n, _ in named]
    assert all(torch.equal(got[n], t) for n, t in named)


def test_receiver_refuses_code_in_a_payload(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(ValueError, match="not allowed"):
        weights.load_payload(base64.b64encode(pickle.dumps(Evil())).decode())
    assert not marker.exists()
    with pytest.raises(ValueError):
        weights.load_payload("%%%")
    with pytest.raises(ValueError):
        weights.payload_tensors({"flattened_tensor": torch.zeros(4, dtype=torch.uint8)}, "flattened_bucket")
    with pytest.raises(ValueError):
        weights.payload_tensors([("x", 3)], None)


def test_unnamed_list_payload_is_accepted():
    """SGLang's default format (no load_format): a list of (name, tensor) pairs."""
    obj = weights.load_payload(weights.serialize([("x", torch.arange(4.0))]))
    (name, t), = weights.payload_tensors(obj, None)
    assert name == "x" and torch.equal(t, torch.arange(4.0))


def test_local_host_detection():
    assert is_local_host("127.0.0.1") and is_local_host("localhost")
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: never assigned to this machine
    assert not is_local_host("no-such-host.invalid")


_RECEIVER = textwrap.dedent("""
    import sys, time, torch
    from slime_server import weights
    port, n = int(sys.argv[1]), int(sys.argv[2])
    pg = weights.open_weight_group("127.0.0.1", port, 2, 1, "big", "gloo", timeout_s=120)
    buf = torch.empty(n, dtype=torch.uint8)
    torch.distributed.broadcast(buf, src=0, group=pg)
    g = torch.Generator().manual_seed(7)
    want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    print("OK" if torch.equal(buf, want) else "MISMATCH", flush=True)
""")


def test_gloo_broadcast_moves_a_200mb_model_between_processes():
    """Rank 0 here, rank 1 in another process, joined by SGLang's rendezvous; 256 MiB arrive intact."""
    n = 256 * 2**20
    port = find_free_port()
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port), str(n)], stdout=subprocess.PIPE, text=True)
    try:
        pg = weights.open_weight_group("127.0.0.1", port, 2, 0, "big", "gloo", timeout_s=120)
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        t0 = time.perf_counter()
        torch.distributed.broadcast(data, src=0, group=pg)
        elapsed = time.perf_counter() - t0
        out, _ = proc.communicate(timeout=120)
        weights.close_weight_group(pg)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "OK", out
    print(f"256 MiB gloo broadcast: {elapsed:.2f} s ({n / elapsed / 1e9:.2f} GB/s)")


def test_unaligned_tensors_start_a_new_bucket():
    """SGLang refuses a tensor whose byte offset is not a multiple of its element size: an odd-sized
    bf16 tensor followed by fp32 goes into two buckets, and such a layout is refused outright."""
    named = [("odd", torch.zeros(3, dtype=torch.bfloat16)), ("f32", torch.zeros(2)), ("f32b", torch.zeros(2))]
    groups = list(weights.group_by_bytes(iter(named), 1 << 20))
    assert [[n for n, _ in g] for g in groups] == [["odd"], ["f32", "f32b"]]
    for g in groups:
        weights.layout_of(g)
    with pytest.raises(ValueError, match="not aligned"):
        weights.layout_of(named)


def test_shm_mappings_are_kept_evicted_by_size_and_dropped_when_gone() -> None:
    """The engine's cache of mapped shared-memory files (``weights._Mappings``): a file named again is not mapped
    again (hundreds of parameter files per push), the least recently used go beyond ``cap`` bytes, a file that is
    gone is dropped at the next miss, and the byte count stays exact through all of it."""
    import gc

    def shared(fill: float) -> tuple[torch.Tensor, str, int]:
        t = torch.full((2**18,), fill)  # 1 MiB
        weights.share_in_place([t])
        with weights.sharing_strategy("file_system"):
            _, handle, size = t.untyped_storage()._share_filename_cpu_()
        return t, handle.decode().lstrip("/"), int(size)

    (a, na, sa), (_b, nb, sb), (c, nc, sc) = shared(1.0), shared(2.0), shared(3.0)  # kept alive: files stay
    m = weights._Mappings(cap=int(2.5 * 2**20))
    got_a = m.get(na, sa)
    assert torch.equal(got_a[-sa:].view(torch.float32), a)  # the file's bytes, after torch's header
    got_b = m.get(nb, sb)
    assert m.get(na, sa) is got_a and m._bytes == got_a.numel() + got_b.numel()  # a hit maps nothing again
    m.get(nc, sc)  # over the cap: b, the least recently used, goes
    assert list(m._maps) == [na, nc] and m._bytes == sum(t.numel() for t in m._maps.values())
    del c
    gc.collect()  # its storage freed: torch unlinks the file
    d, nd, sd = shared(4.0)
    m.get(nd, sd)  # a miss: the gone file's mapping is dropped first
    assert nc not in m._maps and list(m._maps) == [na, nd]
    assert m._bytes == sum(t.numel() for t in m._maps.values())
