"""Issue 43's acceptance for per-user learning: two users with opposite tastes, live through /v1, each learns their
own adapter from their own rewarded conversations (``lora: {per: user}`` on a live job).

The model is the demo's warm start (``tiny-calc``): it answers a word problem with a well-formed calculator call,
an addition about a third of the time (the problems ask for +, - or *, and it picks the operator asked only about
half of the time). A front end holds a frontend key and says per call which of its users it acts for
(``X-Slime-User``). Alice likes additions, Bob any other calculation; after each answer the front end rewards the
session by its user's taste (+1 liked, -1 otherwise). Both play
concurrently, every call naming the served model: the gateway answers each through their own adapter once the
job has published one, the base before. Afterwards Alice's addition rate has risen and Bob's fallen, each
by more than three standard deviations of a difference of two measured rates (binomial, at the base's measured
rate); the base (the admin's calls: no user) answers at its old rate, its weights never moved, and no request
failed. The job anchors each adapter to the base (``loss.kl_coef``; a LoRA job's reference is the base with the
adapters off): without it, at lr 1.5e-3, once a user was nearly always pleased the few disliked answers' negative
gradients squeezed probability into malformed calls (``{"expression": "4"}``) at the twelfth step in 6 of 17
runs (with a batch-wide and with a per-user baseline alike; the same adapter reloaded from the trainer's
checkpoint answered as badly, so it was the training, not the serving); with it, in none of 6. But a clean-clone
CI run drifted with it, and another with the gradient norm also clipped at 0.1 (Alice's rounds 7-11 at 0.75, 0.78,
0.81, 0.84, then 0.53; 45 of her 128 answers malformed after the twelfth step), and a third (0.81, 0.84, 0.88,
then 0.19) while the slower Bob kept both users teaching. So each user teaches until their own last two rounds
show their taste beyond the margin (at most 12 rounds; the other then plays the whole round) and then stops, as
people who got what they wanted would: the adapter learned is what is measured. Training a user on long after
they are nearly always pleased is open (issue 43's note). The rates are measured on 256 answers each.

A third user taking a slot hands it over and back without either losing their taste (each still on their side of
the base, and not back from their measured rate by more than that margin at it); Alice deleting her adapter
while the job runs leaves nothing of hers on the engines or the job's disk, and the base answers her.
CPU engine with LoRA on, the real sgl-router, Ray ranks of Megatron-core, the openai SDK.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from slime_server.buffer.adapter_store import user_alias
from slime_server.demo_learning import calculator_warm_start, demo_rows
from slime_server.envs.calculator import CalculatorEnv
from tests._jobs_helpers import ADMIN, admin, engine_versions, job_events, running_stack, wait_event, wait_job

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
ROWS = demo_rows(256, seed=5)
TOOLS = CalculatorEnv().tools()
PER_ROUND = 32  # conversations per user per round while both teach: one train step a round (64 samples)
N_EVAL = 256
MAX_ROUNDS = 12  # one train step a round; each user stops teaching once their last two rounds show their taste
SEEN: dict[tuple[str | None, int], list[str]] = {}  # (user, seed) -> each answer's operator: printed on the way


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_stack(calculator_warm_start(), tmp_path_factory.mktemp("per-user"), engines=1,
                       ray={"num_cpus": 3}, engine={"enable_lora": True, "max_lora_rank": 8}) as running:
        yield running


def operator_of(message: Any) -> str | None:
    """The operator of the answer's calculator call (None: no call, or not one operator)."""
    for call in message.tool_calls or []:
        try:
            expression = str(json.loads(call.function.arguments).get("expression", ""))
        except (ValueError, AttributeError):
            continue
        ops = re.findall(r"[-+*/]", expression)
        return ops[0] if len(ops) == 1 else None
    return None


async def play(base_url: str, key: str, user: str | None, n: int, *, reward: bool, seed: int) -> list[bool | str]:
    """``n`` one-turn conversations, 8 at a time, as ``user`` (None: the key's own calls): whether each answer was
    an addition (or the error); each session rewarded by the user's taste when ``reward``."""
    headers = {"X-Slime-User": user} if user else {}
    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120, default_headers=headers)
    rest = httpx.AsyncClient(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {key}", **headers})
    model = (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> bool | str:
        row = ROWS[(seed * 31 + i) % len(ROWS)]
        sid = f"{user or 'base'}-{seed}-{i}-{uuid.uuid4().hex[:6]}"
        async with sem:
            try:
                r = await client.chat.completions.create(
                    model=model, messages=[{"role": "system", "content": CalculatorEnv.system_prompt},
                                           {"role": "user", "content": row.prompt}],
                    tools=TOOLS, max_tokens=40, temperature=1.0, extra_headers={"X-Session-Id": sid})
                op = operator_of(r.choices[0].message)
                plus = op == "+"
                SEEN.setdefault((user, seed), []).append(op or "none")
                if reward:  # Alice likes additions, Bob any other calculation (no call at all: neither)
                    liked = plus if user == "alice" else op in ("-", "*", "/")
                    (await rest.post(f"/sessions/{sid}/reward", json={"reward": 1.0 if liked else -1.0})
                     ).raise_for_status()
                return plus
            except Exception as e:  # noqa: BLE001 - counted: no request may fail
                return repr(e)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await client.close()
        await rest.aclose()


def rate(flags: list[bool | str]) -> float:
    return sum(f is True for f in flags) / len(flags)


def spread(p: float) -> float:
    """Three standard deviations of the difference of two rates measured on N_EVAL answers each, at rate p."""
    return 3 * math.sqrt(2 * p * (1 - p) / N_EVAL)


def shows_taste(user: str, last: list[tuple[float, int]], p: float, margin: float) -> bool:
    """Whether ``user``'s last two rounds together put their rate beyond the base's by the margin (Alice above,
    Bob below) and by two standard deviations of a rate of that many answers more, so that the measurement
    afterwards, of the adapter one step further, clears the margin too: the user stops rewarding there, as
    someone who got what they wanted would."""
    if len(last) < 2:
        return False
    n = sum(k for _, k in last)
    q = sum(r * k for r, k in last) / n
    sd = math.sqrt(max(q * (1 - q), 1 / n) / n)
    return q - 2 * sd > p + margin if user == "alice" else q + 2 * sd < p - margin


def test_two_users_opposite_tastes_each_learn_their_own_adapter(server: Any) -> None:
    with admin(server) as c:
        minted = c.post("/admin/keys", json={"role": "frontend", "name": "web"}).raise_for_status().json()
    front, base_url = minted["key"], server.base_url
    errors: list[str] = []

    async def both(n: int, seed: int, reward: bool = True) -> tuple[list[bool | str], list[bool | str]]:
        a, b = await asyncio.gather(play(base_url, front, "alice", n, reward=reward, seed=seed),
                                    play(base_url, front, "bob", n, reward=reward, seed=seed + 1))
        errors.extend(f for f in a + b if isinstance(f, str))
        return a, b

    # the base's rate, and the margin it gives
    before = asyncio.run(play(base_url, ADMIN, None, N_EVAL, reward=False, seed=0))
    p = rate(before)
    margin = spread(p)
    assert p - margin > 0 and p + margin < 1, p  # room to move both ways

    body = {"name": "per-user", "algorithm": "reinforce_plus_plus", "data": {"source": "live"},
            "optimizer": {"lr": 1.5e-3, "clip_grad": 0.1}, "loss": {"kl_coef": 0.1}, "lora": {"rank": 8, "alpha": 16, "per": "user", "adapters": 2},
            "loop": {"batch_size": 2 * PER_ROUND, "n_samples_per_prompt": 1, "max_staleness": 2,
                     "poll_interval_s": 0.05, "checkpoint_interval": 4}}
    with admin(server) as c:
        job = c.post("/jobs", json=body).raise_for_status().json()
    wait_event(server, job["id"], "trainer_ready")
    step, rounds, teaching = 0, 0, ["alice", "bob"]
    history: dict[str, list[tuple[float, int]]] = {"alice": [], "bob": []}

    async def teach(users: list[str], seed: int) -> list[list[bool | str]]:
        n = 2 * PER_ROUND // len(users)  # one step's batch a round, whoever still teaches
        return list(await asyncio.gather(*(play(base_url, front, u, n, reward=True, seed=seed + i)
                                           for i, u in enumerate(users))))

    while teaching and rounds < MAX_ROUNDS:  # each round trained before the next is played
        played = asyncio.run(teach(teaching, seed=100 + 2 * rounds))
        for user, flags in zip(teaching, played, strict=True):
            errors.extend(f for f in flags if isinstance(f, str))
            history[user].append((rate(flags), len(flags)))
        print(f"round {rounds}: addition rate " + ", ".join(f"{u} {history[u][-1][0]:.2f}" for u in teaching))
        step = wait_job(server, job["id"], lambda j, s=step: j["step"] >= s + 1)["step"]  # noqa: B023
        rounds += 1
        teaching = [u for u in teaching if not shows_taste(u, history[u][-2:], p, margin)]
    with admin(server) as c:  # no more updates while we measure
        c.post(f"/jobs/{job['id']}/pause").raise_for_status()
    wait_job(server, job["id"], lambda j: j["status"] == "paused")

    alice, bob = asyncio.run(both(N_EVAL, seed=7, reward=False))
    after = asyncio.run(play(base_url, ADMIN, None, N_EVAL, reward=False, seed=0))
    print(f"addition rate: base {p:.2f} -> {rate(after):.2f}; alice {rate(alice):.2f}, bob {rate(bob):.2f}; "
          f"margin {margin:.2f}; {step} steps in {rounds} rounds")
    gw = server.gateway.server.config.app.state.gw
    store = gw.store
    for who, seed in (("alice", 7), ("bob", 8)):
        adapters = Counter(t.turns[0].lora_adapter for t in store.list_trajectories(limit=100_000)
                           if t.turns and t.session_id.startswith(f"{who}-{seed}-"))
        print(f"{who}: operators {Counter(SEEN[(who, seed)])}, adapters {dict(adapters)}")
    assert errors == []
    assert rate(alice) > p + margin and rate(bob) < p - margin
    assert abs(rate(after) - p) < margin  # the base answers as before
    assert engine_versions(server) == ["0"]  # ... its weights never moved: only adapters were published

    # each user has their own alias, hidden from /v1/models; the engines serve their current versions
    aliases = gw.adapters.aliases
    mine = {u: aliases.get(user_alias(f"key:{minted['id']}/{u}")) for u in ("alice", "bob")}
    assert all(r is not None and r.version >= 1 for r in mine.values()), mine
    with admin(server) as c:
        listed = [m["id"] for m in c.get("/v1/models").json()["data"]]
    assert not any("user-" in m for m in listed), listed
    served_name = Path(server.deployment.model_path).name
    alice_alias = mine["alice"].alias
    for user, status in (("bob", 404), ("alice", 200)):  # a user's adapter answers them alone
        r = httpx.post(f"{base_url}/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {front}", "X-Slime-User": user},
                       json={"model": f"{served_name}:{alice_alias}", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == status, r.text
        if status == 404:
            assert r.json()["error"]["code"] == "model_not_found"
    served = {t.turns[0].lora_adapter or "base" for t in store.list_trajectories(limit=100_000) if t.turns}
    assert all(any(n.startswith(f"{r.alias}@{job['id']}.v") for n in served) for r in mine.values()), served

    # a third user with two slots: Carol's step takes the slot of Alice or Bob (saved, parked); their next step
    # takes Carol's and loads the parked adapter back: both still answer to their taste
    with admin(server) as c:
        c.post(f"/jobs/{job['id']}/resume").raise_for_status()
    for players in (("carol",), ("alice", "bob")):
        async def round_of(players: tuple[str, ...] = players, seed: int = 900 + len(players)) -> None:
            played = await asyncio.gather(*(play(base_url, front, u, 2 * PER_ROUND // len(players), reward=True,
                                                 seed=seed + i)
                                            for i, u in enumerate(players)))
            errors.extend(f for flags in played for f in flags if isinstance(f, str))
        t0 = time.monotonic()
        asyncio.run(round_of())
        print(f"{players} played in {time.monotonic() - t0:.1f} s", flush=True)
        step = wait_job(server, job["id"], lambda j, s=step: j["step"] >= s + 1)["step"]
        print(f"{players} trained at {time.monotonic() - t0:.1f} s", flush=True)
    with admin(server) as c:
        c.post(f"/jobs/{job['id']}/pause").raise_for_status()
        moves = [e["data"] for e in job_events(c, job["id"]) if e["kind"] == "user_slot"]
    wait_job(server, job["id"], lambda j: j["status"] == "paused")
    assert [(m["parked"], m["restored"]) for m in moves][:2] == [(True, False), (True, True)], moves
    learned = rate(alice), rate(bob)
    alice, bob = asyncio.run(both(N_EVAL, seed=9, reward=False))
    print(f"after the slots changed hands: alice {rate(alice):.2f}, bob {rate(bob):.2f}")
    # neither lost their taste: each still on their side of the base, and not back from where they were by more
    # than three standard deviations of a difference of two measured rates (at their own rate; a lost adapter
    # answers as the base does)
    assert errors == [] and rate(alice) > p and rate(bob) < p
    assert rate(alice) > learned[0] - spread(learned[0]) and rate(bob) < learned[1] + spread(learned[1])

    # Alice deletes her adapter while the job runs (paused here): the job lets her go first, then the engines
    # and the disk lose every version of hers and her calls are the base's again; Bob keeps his
    with admin(server) as c:
        gone = c.delete(f"/admin/adapters/{alice_alias}").raise_for_status().json()
        forgotten = [e["data"] for e in job_events(c, job["id"]) if e["kind"] == "user_forgotten"]
        status = c.get(f"/jobs/{job['id']}").raise_for_status().json()["status"]
    assert gone["unloaded"] and all(n.startswith(f"{alice_alias}@") for n in gone["unloaded"]), gone
    assert [f["alias"] for f in forgotten] == [alice_alias] and status == "paused"
    assert aliases.get(alice_alias) is None and aliases.get(mine["bob"].alias) is not None
    served_now = httpx.get(f"{server.deployment.engine_urls[0]}/v1/models", timeout=10).json()["data"]
    assert not any(alice_alias in m["id"] for m in served_now) and any(mine["bob"].alias in m["id"] for m in served_now)
    left = [p for p in (Path(gw.jobs.work_dir) / job["id"]).rglob("*") if alice_alias in p.name]
    assert left == [], left
    sid = f"alice-after-{uuid.uuid4().hex[:6]}"
    r = httpx.post(f"{base_url}/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {front}", "X-Slime-User": "alice", "X-Session-Id": sid},
                   json={"model": served_name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert [t.turns[0].lora_adapter for t in store.get_trajectories(sid)] == [None]  # the base answered her
