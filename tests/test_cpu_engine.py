"""The engine in process: sampling filters, stop handling, seeds under batching, pause/continue, and the
Python staging API for weight updates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from slime_server.rollout.cpu_engine import SCHEDULER_OS_NAME, BadRequest, CPUEngine, EngineConfig
from slime_server.rollout.engine_sequence import KV_INITIAL_HEADROOM
from slime_server.rollout.protocol import SamplingParams
from slime_server.rollout.sampling import draw, filtered_probs, sample_token
from tests._engine_helpers import hf_greedy, hf_model

PROMPT = [31, 32, 33, 34]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = CPUEngine(EngineConfig(model_path=str(tiny_model_path), max_running_requests=8, num_threads=1))
    yield eng
    eng.shutdown()


def test_filters_only_restrict_sampling() -> None:
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    kept = lambda **kw: (filtered_probs(probs, SamplingParams(**kw)) > 0).nonzero()[:, 0].tolist()  # noqa: E731
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.6) == [0, 1]  # mass above token 1 is 0.5 <= 0.6; above token 2 is 0.7
    assert kept(top_p=0.5) == [0, 1]  # SGLang keeps a token while the mass above it is <= top_p
    assert kept(top_p=0.4) == [0]
    assert kept(min_p=0.3) == [0, 1, 2]  # >= 0.3 * 0.5
    assert kept() == [0, 1, 2, 3, 4]
    logits = torch.log(probs)
    g = torch.Generator().manual_seed(0)
    tok, lp, _ = sample_token(logits, SamplingParams(temperature=0.5, top_k=1), g)
    # top_k 1 picks the argmax, but a positive temperature still scales its log-prob
    assert tok == 0 and abs(lp - float(torch.log_softmax(logits / 0.5, -1)[0])) < 1e-6
    tok, lp, _ = sample_token(logits, SamplingParams(temperature=0.0), g)
    assert tok == 0 and abs(lp - float(torch.log_softmax(logits, -1)[0])) < 1e-6
    for _ in range(20):
        tok, lp, _ = sample_token(logits, SamplingParams(temperature=0.5, top_p=0.6), g)
        assert tok in (0, 1)
        assert abs(lp - float(torch.log_softmax(logits / 0.5, -1)[tok])) < 1e-6  # pre-filter log-prob


def test_draws_follow_the_weights() -> None:
    """``draw`` (the engine's sampler) picks each index with probability weight / total: over 60,000 draws each
    count lies within 6 standard deviations of its expectation (a false alarm ~1e-9 per index), an index of
    weight 0 is never drawn (filtered tokens, padding), the first and the last index are reachable, a one-hot row
    always gives its index, and a row without mass is an error rather than a token."""
    g = torch.Generator().manual_seed(11)
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0, 1.0, 2.0]) * 7  # unnormalised
    weights[0], weights[-1] = 0.25, 0.75
    n = 60_000
    counts = torch.bincount(torch.tensor([draw(weights, g) for _ in range(n)]), minlength=len(weights))
    p = weights.double() / weights.double().sum()
    sigma = torch.sqrt(n * p * (1 - p))
    assert bool((counts[p == 0] == 0).all()), counts
    assert bool(((counts - n * p).abs() <= 6 * sigma).all()), (counts.tolist(), (n * p).tolist())
    one_hot = torch.zeros(49152)
    for i in (0, 17, 49151):
        one_hot.zero_()
        one_hot[i] = 1e-30  # however small, the only mass
        assert {draw(one_hot, g) for _ in range(20)} == {i}
    with pytest.raises(RuntimeError, match="invalid sampling distribution"):
        draw(torch.zeros(5), g)
    with pytest.raises(RuntimeError, match="invalid sampling distribution"):
        draw(torch.tensor([1.0, float("nan")]), g)


def test_top_p_on_a_large_vocabulary_keeps_what_the_full_sort_keeps() -> None:
    """top_p reads a topk prefix first and sorts the whole row only when the cut lies past it: peaked rows
    (an LM's usual) and flat ones (the cut past the prefix) keep exactly the tokens of SGLang's rule."""
    g = torch.Generator().manual_seed(3)
    for scale in (0.1, 1.0, 4.0, 12.0):  # flat (cut past the prefix) to peaked (cut within the first tokens)
        probs = torch.softmax(torch.randn(49152, generator=g) * scale, 0)
        ordered, order = torch.sort(probs, descending=True)
        for top_p in (0.05, 0.5, 0.9, 0.99):
            want = torch.zeros(49152, dtype=torch.bool)
            want[order[torch.cumsum(ordered, 0) - ordered <= top_p]] = True  # mass strictly above <= top_p
            got = filtered_probs(probs, SamplingParams(top_p=top_p)) > 0
            assert torch.equal(got, want), (scale, top_p, int(got.sum()), int(want.sum()))


def test_greedy_in_process_matches_hf_across_kv_growth(engine, tiny_model_path) -> None:
    n = KV_INITIAL_HEADROOM + 20  # the K/V buffers grow once mid-generation
    (out,) = engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
    assert out.output_ids == hf_greedy(hf_model(tiny_model_path), PROMPT, n)


def test_ignore_eos_goes_on_past_an_eos_it_picks(tiny_model_path) -> None:
    """SGLang's ``ignore_eos``: an EOS the model picks is produced and generation goes on to max_new_tokens
    (only ``min_new_tokens`` masks EOS); without it the same EOS ends the generation. And the HF greedy reference
    picks that EOS too (it once used generate's min_new_tokens, which masks it: random-weight push tests failed
    whenever EOS came out on top). The model is made to pick EOS first: its (tied) embedding row becomes the
    first greedy token's, scaled so its logit is the larger one."""
    ref = hf_model(tiny_model_path)
    eos = ref.config.eos_token_id
    with torch.no_grad():
        first = hf_greedy(ref, PROMPT, 1)[0]
        top = float(ref(input_ids=torch.tensor([PROMPT])).logits[0, -1, first])
        emb = ref.get_input_embeddings().weight
        emb[eos] = emb[first] * (2.0 if top > 0 else 0.5)
    want = hf_greedy(ref, PROMPT, 6)
    assert want[0] == eos and len(want) == 6
    eng = CPUEngine(EngineConfig(model_path=str(tiny_model_path), num_threads=1))
    try:
        eng.load_weights([("model.embed_tokens.weight", emb.detach().clone())], "eos-first")
        (out,) = eng.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
        assert out.output_ids == want and out.meta_info.finish_reason.type == "length"
        (out,) = eng.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=6))
        assert out.output_ids == [eos] and out.meta_info.finish_reason.type == "stop"
    finally:
        eng.shutdown()


def test_stop_strings_trim_text_but_keep_tokens(engine) -> None:
    sp = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    (free,) = engine.generate(PROMPT, sp)
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop
    (cut,) = engine.generate(PROMPT, sp.model_copy(update={"stop": [stop]}))
    assert cut.meta_info.finish_reason.type == "stop" and cut.meta_info.finish_reason.matched == stop
    assert cut.text == text[: text.index(stop)]
    assert free.output_ids[: len(cut.output_ids)] == cut.output_ids
    (kept,) = engine.generate(PROMPT, sp.model_copy(update={"stop": [stop], "no_stop_trim": True}))
    assert stop in kept.text and kept.output_ids == cut.output_ids


def test_max_new_tokens_zero_and_eos(engine) -> None:
    (zero,) = engine.generate(PROMPT, SamplingParams(max_new_tokens=0))
    assert zero.output_ids == [] and zero.meta_info.finish_reason.type == "length"
    eos = sorted(engine.eos_ids)[0]
    (stops,) = engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[eos]))
    assert stops.meta_info.completion_tokens <= 8
    with pytest.raises(BadRequest, match="context length"):
        engine.generate(PROMPT, SamplingParams(max_new_tokens=engine.context_length))
    rest = engine.resolve(PROMPT, SamplingParams(max_new_tokens=None))  # null: the rest of the context
    assert rest.max_new_tokens == engine.context_length - len(PROMPT)


def test_seeded_samples_do_not_depend_on_batch_company(engine) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=99)
    (alone,) = engine.generate(PROMPT, sp)
    others = [s for i in range(5) for s in engine.new_sequences([40 + i, 41], sp.model_copy(update={"sampling_seed": i}))]
    target = engine.new_sequences(PROMPT, sp)[0]
    for s in [*others[:3], target, *others[3:]]:
        engine.submit(s)
    assert target.done.wait(60)
    assert engine.result(target).output_ids == alone.output_ids
    for s in others:
        assert s.done.wait(60)


def test_weight_version_spans_as_sglang_reports_them(engine) -> None:
    """SGLang's scheduler attaches ``weight_versions`` to finished outputs only: a stream chunk before the
    end has the engine's current ``weight_version`` and no spans; the final output has spans over all its
    tokens (one per version, ``[start, end)``) and the last span's version; an abort from the queue has one
    empty span of the current version."""
    snaps = []
    seq = engine.new_sequences(PROMPT, SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True),
                               stream=True, on_update=lambda s: snaps.append(engine.result(s)))[0]
    before = engine.weight_version
    engine.submit(seq)
    deadline = time.monotonic() + 30
    while len(seq.output_ids) < 5 and time.monotonic() < deadline:
        time.sleep(0.002)
    engine.weight_version = "spans-2"  # what a weight update's commit does, between two decode steps
    try:
        assert seq.done.wait(60)
        final = engine.result(seq)
    finally:
        engine.weight_version = before
    k = final.meta_info.weight_versions[0].end
    assert 5 <= k < 400, "the version changed while the request ran"
    assert [(s.version, s.start, s.end) for s in final.meta_info.weight_versions] == [
        (before, 0, k), ("spans-2", k, 400)]
    assert final.meta_info.weight_version == "spans-2"
    assert final.meta_info.token_versions(400) == [before] * k + ["spans-2"] * (400 - k)
    assert final.wire()["meta_info"]["weight_versions"] == [
        {"version": before, "start": 0, "end": k}, {"version": "spans-2", "start": k, "end": 400}]
    chunks = snaps[:-1]
    assert len(chunks) == 399 and all(c.meta_info.weight_versions is None for c in chunks)
    assert all("weight_versions" not in c.wire()["meta_info"] for c in chunks)
    assert {c.meta_info.weight_version for c in chunks[k:]} == {"spans-2"}
    assert snaps[-1].meta_info.weight_versions == final.meta_info.weight_versions

    engine.pause("in_place")
    try:
        queued = engine.submit(engine.new_sequences(PROMPT, SamplingParams(max_new_tokens=4), rid="queued")[0])
        assert engine.abort("queued") == 1 and queued.done.wait(30)
    finally:
        engine.resume()
    out = engine.result(queued)
    assert out.output_ids == [] and out.meta_info.finish_reason.type == "abort"
    assert [(s.version, s.start, s.end) for s in out.meta_info.weight_versions] == [(before, 0, 0)]


def test_pause_in_place_holds_requests_until_continue(engine) -> None:
    engine.pause("in_place")
    try:
        seq = engine.submit(engine.new_sequences(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))[0])
        time.sleep(0.3)
        assert not seq.done.is_set() and seq.output_ids == []
    finally:
        engine.resume()
    assert seq.done.wait(30) and len(seq.output_ids) == 4


def test_retract_recomputes_and_changes_nothing(engine) -> None:
    """A retract pause mid-generation drops the running requests' KV and recomputes it on resume: with
    the same weights the ids are exactly the uninterrupted ones and the log-probs agree to rounding."""
    sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    alone = engine.generate(PROMPT, sp)[0]
    seq = engine.new_sequences(PROMPT, sp, return_logprob=True)[0]
    engine.submit(seq)
    deadline = time.monotonic() + 30
    while len(seq.output_ids) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.pause("retract")
    try:
        assert engine.load()["num_running_reqs"] == 0 and not seq.done.is_set() and seq.kv == []
        assert engine.flush_cache()  # SGLang: a retract pause leaves nothing running to keep
    finally:
        engine.resume()
    assert seq.done.wait(60)
    out = engine.result(seq)
    assert 5 <= len(out.output_ids) and out.output_ids == alone.output_ids
    ref = engine.generate(PROMPT, sp.model_copy())[0]
    got = [lp for lp, _, _ in out.meta_info.output_token_logprobs]
    seq2 = engine.new_sequences(PROMPT, sp, return_logprob=True)[0]
    engine.submit(seq2)
    assert seq2.done.wait(60) and ref.output_ids == out.output_ids
    want = [lp for lp, _, _ in engine.result(seq2).meta_info.output_token_logprobs]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_python_load_api_switches_atomically(engine, tiny_model_path) -> None:
    """``load_weights`` copies every tensor between two decode steps and takes the version with them;
    a tensor that does not fit is refused before anything is touched."""
    ref = hf_model(tiny_model_path)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(-1.0)
    sp = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    before = engine.generate(PROMPT, sp)[0].output_ids
    with pytest.raises(BadRequest):
        engine.load_weights([*ref.state_dict().items(), ("model.norm.weight", torch.zeros(3))], "bad")
    assert engine.generate(PROMPT, sp)[0].output_ids == before and engine.weight_version != "bad"
    done = threading.Event()
    threading.Thread(target=lambda: (engine.generate(PROMPT, sp), done.set()), daemon=True).start()
    assert engine.load_weights(list(ref.state_dict().items()), "neg") == len(ref.state_dict())
    assert engine.weight_version == "neg"
    assert engine.generate(PROMPT, sp)[0].output_ids == hf_greedy(ref, PROMPT, 10)
    assert done.wait(30)


def test_lean_forward_answers_as_hfs_forward_in_ragged_batches(tiny_model_path) -> None:
    """The engine's own forward (the default) and HF's ``model()`` give the same greedy ids and log-probs
    (1e-5) for sequences of different lengths decoded in one batch, before and after a weight update."""
    from concurrent.futures import ThreadPoolExecutor

    engines = {kind: CPUEngine(EngineConfig(model_path=str(tiny_model_path), max_running_requests=8, forward=kind))
               for kind in ("lean", "hf")}
    assert engines["lean"].lean is not None and engines["hf"].lean is None
    prompts = [PROMPT, list(range(40, 51)), list(range(100, 129)), [7]]
    sp = SamplingParams(temperature=0, max_new_tokens=KV_INITIAL_HEADROOM + 8, ignore_eos=True)

    def run(engine: CPUEngine) -> list:
        with ThreadPoolExecutor(len(prompts)) as pool:  # submitted together: decoded as one batch
            return [o for outs in pool.map(lambda p: engine.generate(p, sp, return_logprob=True), prompts)
                    for o in outs]

    try:
        for _ in range(2):
            got = {kind: run(e) for kind, e in engines.items()}
            assert engines["lean"].stats["decode_steps"] < sum(len(o.output_ids) for o in got["lean"])  # batched
            for a, b in zip(got["lean"], got["hf"], strict=True):
                assert a.output_ids == b.output_ids
                torch.testing.assert_close(torch.tensor([e[0] for e in a.meta_info.output_token_logprobs]),
                                           torch.tensor([e[0] for e in b.meta_info.output_token_logprobs]),
                                           atol=1e-5, rtol=0)
            update = [(n, p.detach() * 0.9) for n, p in hf_model(tiny_model_path).state_dict().items()]
            for e in engines.values():  # the fused weights of the lean forward are the parameters' storage
                e.load_weights(update, "scaled")
    finally:
        for e in engines.values():
            e.shutdown()


def test_decode_batches_whose_members_come_and_go_answer_as_each_sequence_alone(engine) -> None:
    """The decode batch's K/V buffer is reused as sequences leave, join and come in another order (their rows
    move, a joiner's K/V is copied in), rebuilt when it outgrows its rows or length and given back when it is
    far larger than the batch: every decoded position's log-probs equal those of the sequence's whole token list
    run alone (1e-5), whatever the rows no sequence holds contain (NaN here: a joiner's row past its own K/V is
    cleared, masked scores stay finite)."""
    from slime_server.rollout.engine_sequence import Sequence

    lean = engine.lean
    prompts = {"a": list(range(30, 42)), "b": [5, 6, 7], "c": list(range(60, 90)), "d": [11] * 20,
               "e": list(range(100, 107)), "f": [3, 1, 4, 1, 5], "g": list(range(200, 240))}
    seqs: dict[str, Sequence] = {}

    def join(name: str) -> Sequence:
        s = Sequence(rid=name, prompt_ids=prompts[name], params=SamplingParams(max_new_tokens=200))
        s.kv = lean.new_kv(len(s.prompt_ids) + 8)
        logits = lean.prefill(s.prompt_ids, s.kv)
        s.kv_len = len(s.prompt_ids)
        s.output_ids = [int(logits[-1].argmax())]
        seqs[name] = s
        return s

    # a alone (2 rows) -> b joins a free row -> c (past 2 rows: rebuilt, 4) -> a leaves: c moves into its row ->
    # d joins -> the order given changes -> e joins -> long enough that the length doubles -> f and g join (past 4
    # rows: rebuilt, 6) -> d, f, g leave -> c leaves: 6 rows for one sequence is oversized, given back
    plan = ["a", "ab", "abc", "bc", "bcd", "dcb", "cdbe", "ced"] + ["ced"] * 40 + ["cedfg"] * 3 + ["ec"] * 30 + ["e"] * 3
    got: dict[str, list[torch.Tensor]] = {n: [] for n in prompts}
    with torch.inference_mode():
        for names in plan:
            for gone in set(seqs) - set(names):
                seqs[gone].kv = []  # finished: the engine drops its K/V
            batch = [seqs.get(n) or join(n) for n in names]
            logits = lean.decode(batch)
            for s, row in zip(batch, logits, strict=True):
                got[s.rid].append(torch.log_softmax(row.float(), -1))
                s.output_ids.append(int(row.argmax()))
            for kp, vp in lean._pool:  # the rows no one holds now: whatever they keep must not reach a joiner
                kp[len(batch):] = float("nan")
                vp[len(batch):] = float("nan")
        for name, s in seqs.items():
            ids = s.prompt_ids + s.output_ids[:-1]
            alone = lean.prefill(ids, lean.new_kv(len(ids)), all_logits=True)[len(s.prompt_ids):]
            torch.testing.assert_close(torch.stack(got[name]), torch.log_softmax(alone.float(), -1), atol=1e-5,
                                       rtol=0)
    assert lean._cap > 64  # the length did double on the way
    assert lean._pool[0][0].shape[0] == 2  # and the rows of the burst were given back


def test_a_prompt_that_extends_a_finished_one_reuses_its_kv(tiny_model_path) -> None:
    """The next turn of a conversation (the last prompt + answer + a new message) computes only its new
    tokens (SGLang's ``cached_tokens`` says how many were reused) and answers exactly as without reuse;
    a weight update empties the cache."""
    with_cache = CPUEngine(EngineConfig(model_path=str(tiny_model_path)))
    without = CPUEngine(EngineConfig(model_path=str(tiny_model_path), prefix_cache_mb=0))
    sp = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    try:
        first = list(range(40, 80))
        (turn1,) = with_cache.generate(first, sp, return_logprob=True)
        assert turn1.meta_info.cached_tokens == 0
        second = first + turn1.output_ids + [7, 8, 9, 10]
        (a,) = with_cache.generate(second, sp, return_logprob=True)
        (b,) = without.generate(second, sp, return_logprob=True)
        assert a.meta_info.cached_tokens == len(first) + len(turn1.output_ids) - 1  # all but the unfed last token
        assert b.meta_info.cached_tokens == 0
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor([e[0] for e in a.meta_info.output_token_logprobs]),
                                   torch.tensor([e[0] for e in b.meta_info.output_token_logprobs]), atol=1e-5, rtol=0)
        update = [(n, p.detach().clone()) for n, p in hf_model(tiny_model_path).state_dict().items()]
        with_cache.load_weights(update, "v2")
        (c,) = with_cache.generate(second, sp)
        assert c.meta_info.cached_tokens == 0  # K/V of the old weights is gone
        (d,) = with_cache.generate(second + c.output_ids[:3], sp)
        assert d.meta_info.cached_tokens > len(second)  # and the cache fills again
    finally:
        with_cache.shutdown()
        without.shutdown()


def test_prompts_that_arrive_together_share_their_prefix(tiny_model_path) -> None:
    """Prompts admitted in one step (a group of episodes starting at once, the samples of an n > 1 request, a
    burst after a weight update emptied the cache) reuse each other's K/V, as SGLang's radix cache shares a
    prefix between running requests: each computes only what the prompt before it in token order does not
    hold, and every answer and log-prob is what the engine gives without any reuse."""
    with_cache = CPUEngine(EngineConfig(model_path=str(tiny_model_path), max_running_requests=16))
    without = CPUEngine(EngineConfig(model_path=str(tiny_model_path), prefix_cache_mb=0, max_running_requests=16))
    system = list(range(100, 160))  # 60 tokens every prompt starts with
    prompts = [system + [5, 6, 7], system + [5, 6, 8, 9], system + [30] * 12, system[:40] + [1, 2, 3], [9] * 30]
    sp = SamplingParams(temperature=0.7, max_new_tokens=6, ignore_eos=True, sampling_seed=4)
    try:
        results = {}
        for eng in (with_cache, without):
            eng.pause("in_place")  # all of them queued first, so one step admits them together
            seqs = [s for p in prompts for s in eng.new_sequences(p, sp, return_logprob=True)]
            seqs += eng.new_sequences(prompts[0], sp.model_copy(update={"n": 3}), return_logprob=True)
            for s in seqs:
                eng.submit(s)
            eng.resume()
            for s in seqs:
                assert s.done.wait(120)
            results[eng] = [eng.result(s) for s in seqs]
        got, want = results[with_cache], results[without]
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor([e[0] for e in a.meta_info.output_token_logprobs]),
                                       torch.tensor([e[0] for e in b.meta_info.output_token_logprobs]), atol=1e-5,
                                       rtol=0)
        # in token order: [9]*30 shares nothing; system[:40] + [1, 2, 3] is first of the rest (40 over the cut);
        # then prompts[0] x 4 (the n = 3 samples included: all but its last token), prompts[1] (62), prompts[2] (60)
        cached = [r.meta_info.cached_tokens for r in got]
        assert cached[4] == 0 and cached[3] == 0
        assert sorted([cached[0], *cached[5:]]) == [40, 62, 62, 62]
        assert cached[1] == 62 and cached[2] == 60
        assert all(r.meta_info.cached_tokens == 0 for r in want)
    finally:
        with_cache.shutdown()
        without.shutdown()


def test_reused_prefix_prefill_in_chunks_answers_the_same(tiny_model_path, monkeypatch) -> None:
    """After a reused prefix the prefill's causal mask is built per chunk of queries (bounded memory on long
    agent prompts): many small chunks give the same answer as no reuse."""
    from slime_server.rollout import lean_forward

    monkeypatch.setattr(lean_forward, "PREFILL_MASK_ELEMENTS", 200)  # a few queries per chunk
    with_cache = CPUEngine(EngineConfig(model_path=str(tiny_model_path)))
    without = CPUEngine(EngineConfig(model_path=str(tiny_model_path), prefix_cache_mb=0))
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    try:
        (first,) = with_cache.generate(list(range(30, 60)), sp)
        second = list(range(30, 60)) + first.output_ids + list(range(200, 240))  # 40 new tokens: several chunks
        (a,) = with_cache.generate(second, sp, return_logprob=True)
        (b,) = without.generate(second, sp, return_logprob=True)
        assert a.meta_info.cached_tokens > 30 and a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor([e[0] for e in a.meta_info.output_token_logprobs]),
                                   torch.tensor([e[0] for e in b.meta_info.output_token_logprobs]), atol=1e-5, rtol=0)
    finally:
        with_cache.shutdown()
        without.shutdown()


_OWN_THREADS = r"""
import json, sys, threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from slime_server.utils.procs import name_os_thread
name_os_thread("test-main")
import torch
from slime_server import weights
from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
from slime_server.rollout.protocol import SamplingParams

path = sys.argv[1]
engine = CPUEngine(EngineConfig(model_path=path, num_threads=2))
sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
with ThreadPoolExecutor(4) as handlers:  # as the engine server's request handlers
    handlers.submit(engine.generate, [5, 6, 7, 8], sp).result()
    payload = [None]
    maker = threading.Thread(target=lambda: payload.__setitem__(0, weights.serialize_flattened_bucket(
        [("model.norm.weight", torch.full_like(engine._params["model.norm.weight"], 0.5))])))
    maker.start(); maker.join()  # the trainer's side: a thread that is gone before the count
    def from_tensor():
        named = weights.payload_tensors(weights.load_payload(payload[0]), "flattened_bucket")
        return engine.load_weights(named, "1")
    handlers.submit(from_tensor).result()
    handlers.submit(engine.load_weights_from_disk, path, "2").result()
    handlers.submit(engine.generate, [5, 6, 7, 8], sp).result()
    python = {t.native_id for t in threading.enumerate()}
    native = [(p.name, (p / "comm").read_text().strip()) for p in Path("/proc/self/task").iterdir()
              if int(p.name) not in python]
    print(json.dumps({"native": [c for _, c in native], "scheduler": engine._thread.native_id}))
engine.shutdown()
"""


def test_only_the_scheduler_thread_runs_torchs_parallel_ops(tiny_model_path) -> None:
    """Every thread that runs one of torch's parallel (OpenMP) ops keeps a team of OpenMP workers; with more of
    them than cores, libgomp stops spinning between parallel regions and every op of a decode step waits for
    its workers to wake (measured: bf16 SmolLM2 31 instead of 52 tok/s). So the engine computes on its
    scheduler thread alone, loading included: after a start, generations and weight updates from tensors and
    from disk driven from other threads, the only threads Python did not start are the scheduler's OpenMP
    workers, named after it (a parallel op on any other thread leaves a worker named after that thread)."""
    out = subprocess.run([sys.executable, "-c", _OWN_THREADS, str(tiny_model_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["native"] and set(got["native"]) == {SCHEDULER_OS_NAME}, got
