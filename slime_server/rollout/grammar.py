"""Constrained decoding in the CPU engine, as SGLang 0.5.23 does it with its default backend (xgrammar).

Why xgrammar: SGLang's ``/generate`` takes a grammar in ``sampling_params`` (``json_schema``, ``regex``,
``ebnf``, ``structural_tag``; at most one) and compiles it with xgrammar against the served tokenizer; the
compiled grammar gives, at every step, the set of tokens that keep the output inside the grammar (a bitmask
over the vocabulary), and the logits of every other token are set to -inf before sampling. The same library on
the CPU engine means the same grammars are accepted and refused, and the same tokens are allowed, on every
engine. A ``json_schema`` of ``$$ANY$$`` is any JSON value (SGLang's builtin JSON grammar, what its OpenAI
routes send for ``response_format: json_object``).

Log-probs: the mask is applied to the logits the sampler and the log-prob both read (SGLang's
``apply_logits_bias`` before its sampler), so a recorded log-prob is that of the masked, renormalised
distribution the token was drawn from: the behaviour policy.

Refused, with SGLang's message shape (``Failed to compile json grammar: ...``, a 400): a grammar xgrammar
cannot compile, and JSON-schema keywords xgrammar would silently drop (a constraint that does not hold is
worse than an error).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from slime_server.rollout.engine_sequence import Sequence
from slime_server.rollout.grammar_errors import xgrammar_message
from slime_server.rollout.protocol import SamplingParams

ANY_JSON = "$$ANY$$"
CACHE_SIZE = 256  # compiled grammars kept (agents send the same schema every turn)

# JSON-schema keywords that xgrammar 0.2.7 accepts but does not enforce: refused, never dropped.
UNENFORCED_KEYWORDS = frozenset({
    "contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains", "minContains",
    "multipleOf", "not", "then", "uniqueItems",
})
STRING_FORMATS = frozenset({
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer",
    "relative-json-pointer", "time", "uri", "uri-reference", "uri-template", "uuid",
})
_ONE_SCHEMA = ("additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "items",
               "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")


class GrammarError(ValueError):
    """A grammar the engine cannot honour; the message says which and why (a 400)."""


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """The request's grammar as (kind, text): kind is SGLang's (json, regex, ebnf, structural_tag)."""
    for kind, value in (("json", params.json_schema), ("regex", params.regex), ("ebnf", params.ebnf),
                        ("structural_tag", params.structural_tag)):
        if value is not None:
            return kind, value
    return None


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key in _ONE_SCHEMA:
        if isinstance(schema.get(key), dict):
            yield key, schema[key]
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            yield from ((f"{key}[{i}]", s) for i, s in enumerate(schema[key]))
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            yield from ((f"{key}.{name}", s) for name, s in schema[key].items())


def check_json_schema(schema: Any, path: str = "$") -> None:
    """Refuse what xgrammar would not enforce: an unenforced keyword or string format, anywhere in the schema."""
    if not isinstance(schema, dict):
        return
    bad = sorted(UNENFORCED_KEYWORDS & schema.keys())
    if bad:
        raise GrammarError(f"JSON schema keyword {bad[0]!r} at {path} is not supported by constrained decoding")
    fmt = schema.get("format")
    if isinstance(fmt, str) and schema.get("type") in (None, "string") and fmt not in STRING_FORMATS:
        raise GrammarError(f"JSON schema string format {fmt!r} at {path} is not supported by constrained decoding")
    for key, sub in _subschemas(schema):
        check_json_schema(sub, f"{path}.{key}")


class GrammarBackend:
    """Compiles grammars for one tokenizer (cached by kind and text) and masks a batch's logits."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], *, any_whitespace: bool = True,
                 max_whitespace_cnt: int | None = None) -> None:
        import xgrammar as xgr  # ~0.8 s to import: only an engine that is sent a grammar pays it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self.any_whitespace, self.max_whitespace_cnt = any_whitespace, max_whitespace_cnt
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of (kind, text); raises GrammarError with SGLang's message on failure."""
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(kind, text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"Failed to compile {kind} grammar: {xgrammar_message(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> Any:
        if kind == "json":
            if text == ANY_JSON:
                return self.compiler.compile_builtin_json_grammar()
            check_json_schema(json.loads(text))
            return self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace,
                                                     max_whitespace_cnt=self.max_whitespace_cnt)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "ebnf":
            return self.compiler.compile_grammar(text)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(text)
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher (one per sequence: it holds the sequence's position in the grammar)."""
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Set to -inf, in place, the logits (rows of ``logits``) of tokens each row's matcher forbids; a row
        whose matcher is None is left as it is (requests with and without grammars share a batch)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(self._bitmask, i)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask[: logits.shape[0]], vocab_size=self.vocab_size,
                                              indices=rows)


class EngineGrammars:
    """An engine's grammars: the backend is built on the first request that names one (xgrammar's import and its
    scan of the vocabulary are paid only by an engine that is sent a grammar); a matcher per sequence."""

    def __init__(self, enabled: bool, tokenizer: Any, vocab_size: int, eos_ids: list[int], *,
                 any_whitespace: bool = True, max_whitespace_cnt: int | None = None) -> None:
        self.enabled = enabled
        self._args = (tokenizer, vocab_size, eos_ids)
        self._kw = {"any_whitespace": any_whitespace, "max_whitespace_cnt": max_whitespace_cnt}
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def backend(self) -> GrammarBackend:
        if not self.enabled:
            raise GrammarError("Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported "
                               "when the server is launched with --grammar-backend none")  # SGLang's words
        with self._lock:
            if self._backend is None:
                self._backend = GrammarBackend(*self._args, **self._kw)
            return self._backend

    def attach(self, seqs: list[Sequence]) -> None:
        """Compile each sequence's grammar (cached) and give it a matcher of its own (none where it has one)."""
        for seq in seqs:
            key = grammar_key(seq.params)
            if key is not None and seq.grammar is None:
                backend = self.backend()
                seq.grammar = backend.matcher(backend.compile(*key))

    def mask(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """``GrammarBackend.mask`` where any row has a matcher (scheduler thread)."""
        if self._backend is not None and any(m is not None for m in matchers):
            self._backend.mask(logits, matchers)
