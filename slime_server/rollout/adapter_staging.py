"""An adapter version's PEFT files put on another host's disk, for an engine there to load by path.

Why: engines on the trainer's host take an adapter's tensors by reference (shared memory, trainer/adapter_push.py),
but shared memory ends at the host, and SGLang has no by-value or broadcast route for adapters (its
``/load_lora_adapter_from_tensors`` payloads reference shared memory or CUDA IPC handles; its unpickler refuses
tensors by value). What every SGLang serves is ``/load_lora_adapter`` with a ``lora_path`` on the engine's own disk.
So the files travel in Ray's object store (the cluster the trainer ranks and engines already share) to a task pinned
to the engine's node, which writes them there; the engine loads them, and a second task removes them (the engine
holds the adapter in memory from then on). The trainer's pusher stages each new version; the gateway stages a
saved version an engine lost (restarted or evicted). No torch here: the gateway imports it.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from slime_server.lora_format import CONFIG_FILE, WEIGHTS_FILE


def directory_files(path: str | Path) -> dict[str, bytes]:
    """A saved PEFT directory's files, to stage elsewhere."""
    return {name: (Path(path) / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def _write(name: str, files: dict[str, bytes]) -> str:
    out = Path(tempfile.mkdtemp(prefix=f"slime-adapter-{name.replace('/', '_')[:60]}-"))
    for file, data in files.items():
        (out / file).write_bytes(data)
    return str(out)


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def node_of(host: str) -> str:
    """The live Ray node whose address is ``host`` (an engine URL's host), or a RuntimeError saying none is."""
    import ray

    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = host
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for n in nodes:
        if n.get("NodeManagerAddress") in (host, address):
            return str(n["NodeID"])
    raise RuntimeError(f"no live Ray node has the address {host} (nodes: "
                       f"{sorted(str(n.get('NodeManagerAddress')) for n in nodes)}): an adapter for an engine there "
                       "cannot be staged on its disk")


def _on(node: str, fn: Any) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(fn).options(num_cpus=0, max_retries=0,
                                  scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))


def stage(host: str, name: str, files: dict[str, bytes], timeout: float = 300.0) -> str:
    """Write ``files`` into a fresh directory on ``host``'s node; returns its path there."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError(f"an adapter for an engine on {host} is staged through Ray, and this process is not in a "
                           "Ray cluster")
    return str(ray.get(_on(node_of(host), _write).remote(name, files), timeout=timeout))


def unstage(host: str, path: str) -> None:
    """Remove a staged directory from ``host``'s node (not waited for: the engine has loaded it)."""
    _on(node_of(host), _remove).remote(path)
