"""The published-adapter store's contract, run on SQLite (tests/test_adapter_store.py) and Postgres
(tests/test_postgres_store.py)."""

from __future__ import annotations

from slime_server.buffer.adapter_store import AdapterStore, is_version_of, versioned_name


def check_adapter_store(adapters: AdapterStore, reopened: AdapterStore) -> None:
    """Publishing moves an alias and remembers the name it left; a reopened store (a restart, another replica)
    reads the same; deleting removes it."""
    assert adapters.get("mine") is None and adapters.list() == []
    v0 = versioned_name("mine", "job-1", 0)
    first = adapters.publish("mine", v0, 0, "job-1")
    assert (first.name, first.version, first.job_id, first.previous) == (v0, 0, "job-1", None)
    v1 = versioned_name("mine", "job-1", 1)
    second = adapters.publish("mine", v1, 1, "job-1")
    assert (second.name, second.version, second.previous) == (v1, 1, v0)
    assert second.created_at == first.created_at <= second.updated_at
    assert adapters.publish("mine", v1, 1, "job-1").previous is None  # the same version again: nothing left
    assert second.saved_name is None
    adapters.saved("mine", 1, "/ckpt/2/adapter")
    adapters.saved("mine", 0, "/ckpt/1/adapter")  # an older version saved late changes nothing
    got = reopened.get("mine")
    assert (got.saved_version, got.saved_path, got.saved_name) == (1, "/ckpt/2/adapter", v1)
    adapters.publish("other", "other.v0", 0)
    assert [(r.alias, r.name, r.version) for r in reopened.list()] == [("mine", v1, 1), ("other", "other.v0", 0)]
    assert is_version_of(v1, "mine") and not is_version_of(v1, "min") and not is_version_of("other.v0", "mine")
    assert reopened.delete("mine").name == v1 and adapters.get("mine") is None and reopened.delete("mine") is None
