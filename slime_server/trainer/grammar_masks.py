"""The token masks a constrained turn was sampled under, rebuilt for the trainer (issue 42).

Why: a token decoded under a grammar was drawn from the masked, renormalised distribution (the engine sets the
logits of every token the grammar forbids to -inf before sampling), and that is the log-prob recorded. The
unmasked policy gives the same token a lower one (3.0 nats a token on SmolLM2, ``tools/bench_grammar.py``), so
an importance ratio or a PPO ratio between the two is wrong by that much. The trainer computes its log-probs
under the same mask instead: the grammar is recorded with the turn, and replaying it over the recorded tokens
gives, at every generated position, exactly the set of tokens the engine allowed there (the grammar's state is a
function of the tokens accepted so far). The masks travel with the sample as xgrammar's bitmasks (int32 words,
bit ``v % 32`` of word ``v // 32`` set when token ``v`` is allowed).

The buffer keeps these tokens at loss mask 0, so a consumer that cannot apply the grammar (an export read by
another trainer) leaves them out; ``to_train_sample`` turns them on where the masks were rebuilt.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime_server.buffer.schema import Trajectory
from slime_server.rollout.engine_model import model_eos_ids
from slime_server.rollout.grammar import GrammarBackend

log = logging.getLogger(__name__)

# the gateway's sampling_params key -> rollout/grammar.py's kind
_KINDS = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}


class GrammarReplayError(ValueError):
    """A recorded token the replayed grammar does not allow (the engine decoded under another grammar)."""


class GrammarMasker:
    """Rebuilds a trajectory's grammar masks with the served model's tokenizer (built on first use: a job whose
    samples carry no grammar never loads xgrammar)."""

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = str(model_path)
        self._backend: Any = None
        self._lock = threading.Lock()

    def backend(self) -> Any:
        with self._lock:
            if self._backend is None:
                from transformers import AutoConfig, AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                config = AutoConfig.from_pretrained(self.model_path)
                eos = model_eos_ids(Path(self.model_path), config)
                if tokenizer.eos_token_id is not None:
                    eos.add(int(tokenizer.eos_token_id))
                self._backend = GrammarBackend(tokenizer, int(config.vocab_size), sorted(eos))  # SGLang's defaults
            return self._backend

    def masks(self, t: Trajectory) -> tuple[list[int], bytes] | None:
        """(positions, bitmask bytes [len(positions), words]) of ``t``'s constrained turns' generated tokens;
        None when it has none."""
        turns = [turn for turn in t.turns if turn.grammar]
        if not turns:
            return None
        backend = self.backend()
        xgr = backend._xgr
        positions: list[int] = []
        rows: list[torch.Tensor] = []
        for turn in turns:
            (key, text), = turn.grammar.items()
            matcher = backend.matcher(backend.compile(_KINDS[key], text))
            for p in range(turn.output_start, turn.output_end):
                row = xgr.allocate_token_bitmask(1, backend.vocab_size)
                matcher.fill_next_token_bitmask(row, 0)
                if not matcher.accept_token(t.tokens[p]):
                    raise GrammarReplayError(f"trajectory {t.id}: token {t.tokens[p]} at {p} is not allowed by "
                                             f"its turn's recorded {key} grammar")
                positions.append(p)
                rows.append(row[0])
        return positions, torch.stack(rows).numpy().astype("<i4").tobytes()


def allowed_columns(bitmask: bytes, count: int, start: int, width: int, vocab_size: int) -> torch.Tensor:
    """Bool [count, width]: which of global token ids ``start .. start + width - 1`` each row allows (a TP rank's
    vocab shard; ids at or past ``vocab_size``, the padding, are never allowed)."""
    words = torch.from_numpy(np.frombuffer(bitmask, dtype="<i4").reshape(count, -1).copy())
    cols = torch.arange(start, start + width)
    inside = cols < vocab_size
    safe = cols.clamp(max=vocab_size - 1)
    bits = (words[:, safe // 32] >> (safe % 32)) & 1
    return bits.bool() & inside
