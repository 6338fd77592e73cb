"""What the buffer's polls cost, side by side on the same SQLite store:

- the trainer loop's poll: reading the pool whole (``list_trajectories``, as the loop did) vs reading its heads
  (``list_heads``) and then the chosen batch whole by id (``get_trajectories_by_id``). The loop polls every
  ``poll_interval_s`` (0.2 s by default) while it waits for whole groups, so a poll that decodes every buffered
  trajectory's token arrays and messages costs in proportion to the pool's tokens;
- buffer pacing's count (every 0.5 s while a job trains): ``stats()`` (every count of the store, as pacing read
  it) vs ``count_ready()``; ``--trained`` trajectories already trained make the store outgrow the buffer.

    python tools/bench_buffer_poll.py --tokens 100,2000,16000 --pool 256 --batch 16 --trained 5000
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

from slime_server.buffer.schema import NormalizedMessage, Trajectory, Turn
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.buffer.store import ResponseRef, TurnWrite


def fill(store: SQLiteTrajectoryStore, pool: int, n_tokens: int, group: int, trained: int = 0) -> None:
    """``trained`` trajectories already trained on, then ``pool`` finished, rewarded ones, of ``n_tokens`` each
    (half prompt, half generated), with messages."""
    prompt = n_tokens // 2
    for i in range(trained + pool):
        sid = f"s{i}"
        store.create_session(sid)
        t = Trajectory(session_id=sid, group_id=f"g{i // group}", tokens=list(range(n_tokens)),
                       loss_mask=[0] * prompt + [1] * (n_tokens - prompt), rollout_logprobs=[-0.5] * n_tokens,
                       weight_versions=[-1] * prompt + [3] * (n_tokens - prompt),
                       turns=[Turn(response_id=f"r{i}", prompt_start=0, output_start=prompt, output_end=n_tokens,
                                   finish_reason="stop")],
                       messages=[NormalizedMessage(role="user", content="x" * (3 * prompt)),
                                 NormalizedMessage(role="assistant", content="y" * (3 * (n_tokens - prompt)))],
                       turn_rewards=[None])
        store.write_turn(TurnWrite(session_id=sid, trajectories=[t],
                                   responses=[ResponseRef(response_id=f"r{i}", choice=0, trajectory_id=t.id)]))
        store.set_reward(sid, reward=float(i % 2), finish=True)
        if i < trained:
            store.mark_consumed([t.id], 1)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 2)


def measure(store: SQLiteTrajectoryStore, filters: dict, batch: int, repeats: int) -> dict[str, float]:
    chosen = [h.id for h in store.list_heads(**filters)[:batch]]
    whole = median_ms(lambda: store.list_trajectories(**filters), repeats)
    heads = median_ms(lambda: store.list_heads(**filters), repeats)
    fetch = median_ms(lambda: store.get_trajectories_by_id(chosen), repeats)
    stats = median_ms(store.stats, repeats)
    count = median_ms(store.count_ready, repeats)
    return {"pool_whole_ms": whole, "heads_ms": heads, "batch_whole_ms": fetch,
            "poll_speedup": round(whole / (heads + fetch), 1), "pacing_stats_ms": stats, "pacing_count_ms": count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="100,2000,16000", help="tokens per trajectory, one run per value")
    ap.add_argument("--pool", type=int, default=256, help="buffered trajectories (the loop reads up to 256)")
    ap.add_argument("--batch", type=int, default=16, help="trajectories chosen and read whole")
    ap.add_argument("--trained", type=int, default=0, help="trajectories already trained on, also in the store")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    filters = {"status": "finished", "rewarded": True, "unconsumed": True, "limit": a.pool}
    rows = []
    for n_tokens in map(int, a.tokens.split(",")):
        with tempfile.TemporaryDirectory(prefix="bench_buffer_poll_") as d:
            store = SQLiteTrajectoryStore(f"{d}/buffer.db")
            fill(store, a.pool, n_tokens, group=8, trained=a.trained)
            rows.append({"tokens": n_tokens, "pool": a.pool, "trained": a.trained,
                         **measure(store, filters, a.batch, a.repeats)})
            store.close()
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
