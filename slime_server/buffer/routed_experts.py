"""An MoE trajectory's routed experts: for each of its first ``positions`` tokens, the top-k experts of every layer
the engine's router chose (SGLang's ``routed_experts``), kept compact beside the token arrays.

Why compact: a Qwen3-30B-A3B token routes through 48 layers x top-8: as SGLang's int32 that is 1.5 KB a token,
more than the token's other arrays together by ~70x; expert ids fit a byte up to 256 experts (two above), so the
store keeps 384 bytes a token there. Routing replay (trainer/routing_replay.py) reads them back as int64 ids.

Positions: a turn's answer covers [start, prompt + output - 1) (the last output token never ran), so a trajectory
holds routes for all but its last token; a later turn extends them from where they end.
"""

from __future__ import annotations

import struct
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

_HEADER = struct.Struct("<BHH")  # itemsize, layers, topk: a stored value's first five bytes


class RoutedExperts(BaseModel):
    """Top-k expert ids [positions, layers, topk], as unsigned little-endian ints of ``itemsize`` bytes."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64", frozen=True)

    layers: int = Field(ge=1, le=65535)
    topk: int = Field(ge=1, le=65535)
    itemsize: Literal[1, 2] = 1
    data: bytes = b""

    @model_validator(mode="after")
    def _whole_rows(self) -> RoutedExperts:
        if len(self.data) % self.row_bytes:
            raise ValueError(f"routed experts of {len(self.data)} bytes are not whole [{self.layers}, {self.topk}] "
                             f"rows of {self.itemsize}-byte ids")
        return self

    @property
    def row_bytes(self) -> int:
        return self.layers * self.topk * self.itemsize

    @property
    def positions(self) -> int:
        return len(self.data) // self.row_bytes

    @property
    def dtype(self) -> str:
        return "u1" if self.itemsize == 1 else "<u2"

    def array(self) -> np.ndarray:
        """int64 [positions, layers, topk]."""
        raw = np.frombuffer(self.data, dtype=self.dtype)
        return raw.astype(np.int64).reshape(self.positions, self.layers, self.topk)

    @classmethod
    def of(cls, ids: np.ndarray) -> RoutedExperts:
        """From an int array [positions, layers, topk] (the engine's); ids must be in [0, 65536)."""
        ids = np.asarray(ids)
        if ids.ndim != 3 or ids.shape[1] == 0 or ids.shape[2] == 0:
            raise ValueError(f"routed experts must be [positions, layers, topk], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > 65535):
            raise ValueError(f"expert ids must be in [0, 65536), got [{ids.min()}, {ids.max()}]")
        itemsize = 1 if not ids.size or ids.max() < 256 else 2
        data = ids.astype("u1" if itemsize == 1 else "<u2").tobytes()
        return cls(layers=ids.shape[1], topk=ids.shape[2], itemsize=itemsize, data=data)

    def head(self, positions: int) -> RoutedExperts:
        """The first ``positions`` rows (all when there are fewer)."""
        return self.model_copy(update={"data": self.data[: max(0, positions) * self.row_bytes]})

    def extended(self, start: int, more: np.ndarray) -> RoutedExperts:
        """Rows [0, start) of these, then ``more`` (an answer's routes from position ``start``)."""
        if start > self.positions:
            raise ValueError(f"routes from position {start} do not join the {self.positions} held")
        more = np.asarray(more)
        if more.ndim != 3 or more.shape[1:] != (self.layers, self.topk):
            raise ValueError(f"routes of shape {more.shape} do not join [positions, {self.layers}, {self.topk}]")
        return RoutedExperts.of(np.concatenate([self.head(start).array(), more.astype(np.int64)]))

    def pack(self) -> bytes:
        """The stored bytes: a five-byte header (itemsize, layers, topk), then the ids."""
        return _HEADER.pack(self.itemsize, self.layers, self.topk) + self.data

    @classmethod
    def unpack(cls, blob: bytes | memoryview | None) -> RoutedExperts | None:
        if blob is None:
            return None
        blob = bytes(blob)
        itemsize, layers, topk = _HEADER.unpack_from(blob)
        return cls(layers=layers, topk=topk, itemsize=itemsize, data=blob[_HEADER.size:])
