"""An adapter version's PEFT files put on another host's disk, for an engine there to load by path.

Why: engines on the trainer's host take an adapter's tensors by reference (shared memory, trainer/adapter_push.py),
but shared memory ends at the host, and SGLang has no by-value or broadcast route for adapters (its
``/load_lora_adapter_from_tensors`` payloads reference shared memory or CUDA IPC handles; its unpickler refuses
tensors by value). What every SGLang serves is ``/load_lora_adapter`` with a ``lora_path`` on the engine's own disk.
So the files travel in Ray's object store (the cluster the trainer ranks and engines already share) to a task pinned
to the engine's node, which writes them there, and the engine loads them. The files stay while the version is
served: an engine reloads an adapter it evicted (its LRU over ``max_loaded_loras``) or was told to unload from the
path it was loaded from, as SGLang does, so they go only when the version is unloaded for good (``unstage``, by
name: one directory per version on each node). The trainer's pusher stages each new version; the loop's and the
gateway's loads of a saved version stage it too. No torch here: the gateway imports it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from slime_server.lora_format import CONFIG_FILE, WEIGHTS_FILE
from slime_server.utils.net import is_local_host


def directory_files(path: str | Path) -> dict[str, bytes]:
    """A saved PEFT directory's files, to stage elsewhere."""
    return {name: (Path(path) / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def staged_dir(name: str) -> Path:
    """Where version ``name`` is staged on a node (its temp directory; the name made safe, and hashed so two
    names never share a directory)."""
    safe = re.sub(r"[^A-Za-z0-9@._-]", "_", name)[:80]
    return Path(tempfile.gettempdir()) / "slime-adapters" / f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def _write(name: str, files: dict[str, bytes]) -> str:
    """On the engine's node: the files in the version's directory, replacing what was there."""
    final = staged_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".staging-"))
    for file, data in files.items():
        (tmp / file).write_bytes(data)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return str(final)


def _remove(name: str) -> None:
    shutil.rmtree(staged_dir(name), ignore_errors=True)


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
    """Write ``files`` into version ``name``'s directory on ``host``'s node; returns its path there."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError(f"an adapter for an engine on {host} is staged through Ray, and this process is not in a "
                           "Ray cluster")
    return str(ray.get(_on(node_of(host), _write).remote(name, files), timeout=timeout))


def unstage(host: str, name: str) -> None:
    """Remove version ``name``'s staged files from ``host``'s node, once it is unloaded for good (not waited for);
    nothing to do where nothing can have been staged (this process is not in a Ray cluster)."""
    import ray

    if ray.is_initialized():
        _on(node_of(host), _remove).remote(name)


def path_for_engine(host: str, name: str, path: str) -> str:
    """Where an engine on ``host`` loads the saved PEFT directory ``path`` from, as version ``name``: ``path`` on
    this host, else its files staged on the engine's."""
    return path if is_local_host(host) else stage(host, name, directory_files(path))


def unstage_for_engine(host: str, name: str) -> None:
    """Version ``name`` unloaded for good from an engine on ``host``: its staged copy goes (none on this host)."""
    if not is_local_host(host):
        unstage(host, name)
