"""The receiving end of a colocated weight push, done with SGLang's own code (GPU test: test_gpu_colocated.py).

SGLang itself cannot be installed where the GPU test runs, so this process serves the few routes the trainer's
``WeightPusher`` calls and handles ``/update_weights_from_tensor`` the way SGLang 0.5.23's TP workers do, with
SGLang's functions taken from the pinned wheel (``tests/_sglang_source.py``): its ``monkey_patch_torch_reductions``
applied first (as its model runner does), each TP rank's entry of ``serialized_named_tensors`` base64-decoded and
loaded with its ``SafeUnpickler``, and the flattened bucket rebuilt by its ``FlattenedTensorBucket``. What it
received (first TP rank's tensors, copied to the CPU) is written to ``--out`` on ``POST /dump``. ``GET /server_info``
says ``tp_size``, as SGLang's does.

Run: ``python tests/_sglang_ipc_receiver.py --port P --tp 2 --out received.pt``
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import traceback
from http.server import HTTPServer
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._json_http import JsonHandler  # noqa: E402
from tests._sglang_source import (  # noqa: E402  (the repository root goes on the path first)
    TENSOR_BUCKET,
    load_by_path,
    safe_unpickler_class,
    torch_reductions_patch,
)


class Receiver:
    """What SGLang's engine would hold: the loaded tensors and the weight version."""

    def __init__(self, tp: int, cuda: bool) -> None:
        self.tp, self.cuda = tp, cuda
        self.version = "0"
        self.tensors: dict[str, torch.Tensor] = {}
        self.requests: list[dict[str, Any]] = []
        self.uuid = str(torch.cuda.get_device_properties(0).uuid) if cuda else ""
        self.unpickler = safe_unpickler_class()
        self.bucket = load_by_path(TENSOR_BUCKET)
        torch_reductions_patch()()  # as SGLang's model runner does before it loads CUDA payloads

    def update_from_tensor(self, body: dict[str, Any]) -> None:
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.tp:
            raise ValueError(f"{len(payloads)} payloads for {self.tp} TP ranks")
        if body.get("load_format") != "flattened_bucket":
            raise ValueError(f"load_format {body.get('load_format')!r}")
        names = [self._load(rank, payload) for rank, payload in enumerate(payloads)][0]
        if self.cuda:
            torch.cuda.synchronize()
        uuid_in_payload = bool(self.uuid) and all(self.uuid.encode() in base64.b64decode(p) for p in payloads)
        self.requests.append({"payloads": len(payloads), "names": names, "uuid_in_payload": uuid_in_payload,
                              "flush_cache": bool(body.get("flush_cache")), "weight_version": body.get("weight_version")})
        if body.get("weight_version") is not None:
            self.version = str(body["weight_version"])


    def _load(self, rank: int, payload: str) -> list[str]:
        """What TP worker ``rank`` does with ``serialized_named_tensors[rank]``; the rebuilt tensors (and so the
        IPC handles) are gone when it returns, as once SGLang's model has copied them."""
        obj = self.unpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
        metas = [self.bucket.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                                     end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
        rebuilt = self.bucket.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                                    metadata=metas).reconstruct_tensors()
        for name, tensor in rebuilt:
            if tensor.is_cuda != self.cuda:
                raise ValueError(f"{name} arrived on {tensor.device}")
            if rank == 0:  # as the model's load_weights: a copy on the device
                self.tensors[name] = tensor.detach().clone()
            elif not torch.equal(self.tensors[name], tensor):
                raise ValueError(f"TP rank {rank} got another {name} than rank 0")
        return [n for n, _ in rebuilt]


def serve(port: int, tp: int, out: Path, cuda: bool) -> None:
    receiver = Receiver(tp, cuda)

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path == "/model_info":
                self.answer(200, {"model_path": "colocated", "weight_version": receiver.version})
            elif self.path == "/server_info":
                self.answer(200, {"tp_size": receiver.tp, "weight_version": receiver.version})
            else:
                self.answer(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = self.read_json()
            try:
                if self.path == "/update_weights_from_tensor":
                    receiver.update_from_tensor(body)
                elif self.path == "/dump":
                    torch.save({"tensors": {k: t.cpu() for k, t in receiver.tensors.items()}, "requests": receiver.requests,
                                "version": receiver.version}, out)
                elif self.path not in ("/pause_generation", "/continue_generation"):
                    self.answer(404, {"detail": "Not Found"})
                    return
            except Exception as e:  # noqa: BLE001  (SGLang answers a failed update with success false)
                traceback.print_exc()
                self.answer(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
                return
            self.answer(200, {"success": True, "message": "Succeeded"})

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    serve(args.port, args.tp, args.out, cuda=True)
