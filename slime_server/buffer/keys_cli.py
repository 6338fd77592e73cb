"""``slime-server keys create|list|revoke``: minted keys in a server's store, offline (SQLite or Postgres)."""

from __future__ import annotations

import json
import sys

from slime_server.buffer.open import open_key_store


class KeysCommand:
    """``slime-server keys create|list|revoke``: manage minted keys in a server's store (offline)."""

    help = "mint, list or revoke API keys (agent or admin) in the trajectory store"

    def add_arguments(self, parser) -> None:
        parser.add_argument("action", choices=("create", "list", "revoke"))
        parser.add_argument("key_id", nargs="?", help="revoke: the key's id")
        parser.add_argument("--db-path", default=None, help="SQLite store (default: settings gateway.db_path)")
        parser.add_argument("--role", choices=("agent", "admin", "frontend"), default="agent")
        parser.add_argument("--name", default="", help="a label: who holds the key")

    def run(self, args, settings) -> int:
        store = open_key_store(args.db_path or settings.gateway.db_path)
        try:
            if args.action == "create":
                minted = store.mint(args.role, args.name)
                print(json.dumps(minted.model_dump()))
                print("the key is shown only now; the store keeps its hash", file=sys.stderr)
            elif args.action == "list":
                for record in store.list():
                    print(json.dumps(record.model_dump()))
            else:
                if not args.key_id or store.revoke(args.key_id) is None:
                    print(f"error: unknown key {args.key_id!r}", file=sys.stderr)
                    return 2
            return 0
        finally:
            store.close()
