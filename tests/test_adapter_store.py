"""Published LoRA adapters' aliases on SQLite (the Postgres run is in tests/test_postgres_store.py)."""

from __future__ import annotations

from pathlib import Path

from slime_server.buffer.open import open_adapter_store
from tests._adapter_store_contract import check_adapter_store


def test_aliases_move_and_survive_a_reopen(tmp_path: Path) -> None:
    a, b = open_adapter_store(tmp_path / "db.sqlite"), open_adapter_store(tmp_path / "db.sqlite")
    try:
        check_adapter_store(a, b)
    finally:
        a.close()
        b.close()
