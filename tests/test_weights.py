"""Bucket format: bit-exact round trips, the size bound, zero-copy views, shm and raw-bytes transport."""

from __future__ import annotations

import os

import pytest
import torch

from slime_server import weights
from slime_server.weights import BucketMeta, TensorMeta


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(17, 5, generator=g)),
        ("b.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("c.half", torch.randn(2, 3, 4, generator=g).to(torch.float16)),
        ("d.ids", torch.randint(-(2**40), 2**40, (7,), generator=g)),
        ("e.mask", torch.rand(9, generator=g) > 0.5),
        ("f.scalar", torch.tensor(3.25, dtype=torch.float64)),
        ("g.empty", torch.empty(0, 4)),
        ("h.noncontig", torch.randn(6, 4, generator=g).t()),
        ("i.int8", torch.randint(-128, 127, (33,), dtype=torch.int8, generator=g)),
    ]


@pytest.mark.parametrize("shm_dir", [None, True])
@pytest.mark.parametrize("max_bytes", [64, 200, 1 << 20])
def test_round_trip_is_bit_exact_and_respects_the_bound(shm_dir, max_bytes: int) -> None:
    named = _mixed()
    buckets = list(weights.pack_buckets(named, max_bytes=max_bytes, shm_dir=shm_dir))
    got = [kv for b in buckets for kv in weights.unpack(b)]
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))
    for b in buckets:
        single_oversized = len(b.meta.tensors) == 1
        assert b.nbytes <= max_bytes or single_oversized
        assert all(t.offset % b.meta.alignment == 0 for t in b.meta.tensors)
        assert (b.path is not None) == (shm_dir is True and os.access("/dev/shm", os.W_OK))
    if max_bytes == 64:
        big = [b for b in buckets if b.nbytes > 64]
        assert big and all(len(b.meta.tensors) == 1 for b in big)
    if max_bytes == 1 << 20:
        assert len(buckets) == 1


def test_unpacked_tensors_are_views_of_the_bucket() -> None:
    (bucket,) = weights.pack_buckets(_mixed(), max_bytes=1 << 20, shm_dir=None)
    base = bucket.buffer.data_ptr()
    views = dict(weights.unpack(bucket))
    for m in bucket.meta.tensors:
        if m.nbytes:
            assert views[m.name].data_ptr() == base + m.offset
    bucket.buffer.zero_()
    assert float(views["a.weight"].abs().sum()) == 0.0


def test_bytes_and_shm_transport_round_trip(tmp_path) -> None:
    named = _mixed()
    (bucket,) = weights.pack_buckets(named, max_bytes=1 << 20, shm_dir=str(tmp_path))
    assert bucket.path is not None and os.path.getsize(bucket.path) == bucket.nbytes
    meta = BucketMeta.model_validate_json(bucket.meta.model_dump_json())
    from_file = weights.read_shm(bucket.path, meta)
    from_raw = weights.from_bytes(bytes(weights.to_bytes(bucket)), meta)
    for other in (from_file, from_raw):
        for (name, want), (name2, have) in zip(named, weights.unpack(other), strict=True):
            assert name == name2 and torch.equal(have, want)
    path = bucket.path
    del bucket, from_file
    import gc

    gc.collect()
    assert not os.path.exists(path), "the producer's shm file goes away with its bucket"


def test_inconsistent_metadata_is_refused() -> None:
    (bucket,) = weights.pack_buckets([("w", torch.ones(4))], max_bytes=1024, shm_dir=None)
    too_far = BucketMeta(total_bytes=16, tensors=[TensorMeta(name="w", dtype="float32", shape=[4], offset=8,
                                                             nbytes=16)])
    with pytest.raises(ValueError, match="exceed"):
        weights.unpack_buffer(bucket.buffer, too_far)
    wrong_size = BucketMeta(total_bytes=16, tensors=[TensorMeta(name="w", dtype="float32", shape=[3], offset=0,
                                                                nbytes=16)])
    with pytest.raises(ValueError, match="nbytes"):
        weights.unpack_buffer(bucket.buffer, wrong_size)
    with pytest.raises(ValueError, match="meta says"):
        weights.from_bytes(b"\0" * 15, bucket.meta)
    with pytest.raises(ValueError):
        TensorMeta(name="w", dtype="complex128", shape=[1], offset=0, nbytes=16)


def test_pack_copies_once_into_a_preallocated_buffer() -> None:
    """Packing is a single pass over the sources: the buffer is allocated once and filled in place."""
    src = torch.randn(1 << 18)
    (bucket,) = weights.pack_buckets([("x", src)], max_bytes=1 << 22, shm_dir=None)
    assert bucket.buffer.numel() == src.numel() * 4
    src.add_(1.0)  # the bucket owns a copy, not a view of the source
    assert not torch.equal(dict(weights.unpack(bucket))["x"], src)


def test_local_host_detection() -> None:
    assert weights.is_local_host("127.0.0.1") and weights.is_local_host("localhost")
    assert not weights.is_local_host("192.0.2.1")  # TEST-NET-1: never assigned to this machine
    assert not weights.is_local_host("no-such-host.invalid")
