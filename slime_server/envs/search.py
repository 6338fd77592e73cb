"""``search``: Search-R1-lite. Questions answered by searching a local corpus (BM25, no network).

The default corpus is generated from a seed: short encyclopedia-style facts about fictional
places, so answers cannot come from a model's prior knowledge, only from searching. Users pass
their own corpus (a JSONL of ``{"id", "text"}``) and dataset rows. Reward: exact match of the final
answer (or of its ``<answer>...</answer>``) with the label.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

from slime_server.envs.base import DatasetRow, Environment, EpisodeState
from slime_server.envs.rewards import exact_match, extract_answer

_WORD = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 over a small in-memory corpus."""

    def __init__(self, docs: list[dict[str, str]], k1: float = 1.5, b: float = 0.75) -> None:
        self.docs = docs
        self.tf = [Counter(tokenize(d["text"])) for d in docs]
        self.len = [sum(tf.values()) for tf in self.tf]
        self.avg = sum(self.len) / max(1, len(self.len))
        df = Counter(w for tf in self.tf for w in tf)
        n = len(docs)
        self.idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self.k1, self.b = k1, b

    def search(self, query: str, k: int = 3) -> list[dict[str, str]]:
        q = tokenize(query)
        scores = []
        for i, tf in enumerate(self.tf):
            s = 0.0
            for w in q:
                if w in tf:
                    f = tf[w]
                    s += self.idf[w] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg))
            scores.append((s, i))
        return [self.docs[i] for s, i in sorted(scores, reverse=True)[:k] if s > 0]


SYLLABLES = ["ka", "lo", "mi", "ra", "ten", "vu", "zo", "bel", "dar", "fin", "gor", "hul"]
FIELDS = [("capital", "The capital of {p} is {v}."), ("river", "The longest river of {p} is the {v}."),
          ("animal", "The national animal of {p} is the {v}.")]
QUESTIONS = {"capital": "What is the capital of {p}?", "river": "What is the longest river of {p}?",
             "animal": "What is the national animal of {p}?"}


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def generated_world(n_places: int = 40, seed: int = 0) -> tuple[list[dict[str, str]], list[DatasetRow]]:
    rng = random.Random(seed)
    docs, rows = [], []
    for i in range(n_places):
        place = _name(rng)
        for field, template in FIELDS:
            value = _name(rng)
            docs.append({"id": f"d{i}-{field}", "text": template.format(p=place, v=value)})
            rows.append(DatasetRow(prompt=QUESTIONS[field].format(p=place), label=value,
                                   metadata={"doc": f"d{i}-{field}"}))
    return docs, rows


class SearchEnv(Environment):
    name = "search"
    system_prompt = "Answer the question. Use the search tool to find facts. Give the final answer in <answer></answer>."
    max_turns = 4

    def __init__(self, corpus: str | None = None, seed: int = 0) -> None:
        if corpus is not None:
            docs = [json.loads(line) for line in Path(corpus).read_text(encoding="utf-8").splitlines() if line.strip()]
            self._rows: list[DatasetRow] = []
        else:
            docs, self._rows = generated_world(seed=seed)
        self.index = BM25(docs)

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {
            "name": "search", "description": "Search the encyclopedia; returns the best matching passages.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]

    def call_tool(self, state: EpisodeState, name: str, arguments: dict[str, Any]) -> str:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return "error: 'query' must be a non-empty string"
        hits = self.index.search(query)
        return "\n".join(f"[{d['id']}] {d['text']}" for d in hits) or "no results"

    def reward(self, state: EpisodeState, final_text: str) -> float:
        return exact_match(extract_answer(final_text), str(state.row.label))

    def default_dataset(self, n: int, seed: int = 0) -> list[DatasetRow]:
        if not self._rows:
            raise NotImplementedError("a custom corpus needs its own dataset")
        rng = random.Random(seed)
        return [rng.choice(self._rows) for _ in range(n)]
