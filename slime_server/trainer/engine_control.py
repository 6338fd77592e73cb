"""The live engines as a job's loop sees them: their URLs (which may change), pause/continue for sync-mode steps,
their weight versions, and (LoRA jobs publishing adapters) loading and unloading adapter versions, SGLang's routes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from slime_server.rollout.adapter_staging import path_for_engine, unstage_for_engine
from slime_server.rollout.engine_auth import auth_headers
from slime_server.rollout.engine_info import engine_weight_version
from slime_server.utils.net import engine_limits


class EngineControl:
    """The live engines as the loop sees them: their URLs (which may change) and pause/continue."""

    def __init__(self, urls: Callable[[], list[str]], timeout: float = 60.0, api_key: str | None = None) -> None:
        self.urls = urls
        self._client = httpx.Client(timeout=timeout, headers=auth_headers(api_key), limits=engine_limits())

    def _all(self, path: str, body: dict[str, Any] | None = None) -> None:
        for url in self.urls():
            self._client.post(f"{url}{path}", json=body or {}).raise_for_status()

    def pause(self) -> None:
        # in_place: running requests stay and finish after /continue_generation (never aborted)
        self._all("/pause_generation", {"mode": "in_place"})

    def versions(self) -> list[str | None]:
        """Each engine's ``weight_version`` from SGLang's ``/model_info`` (None where it does not answer)."""
        return [engine_weight_version(self._client, url) for url in self.urls()]

    def resume(self) -> None:
        self._all("/continue_generation")

    def load_adapter(self, name: str, path: str) -> dict[str, str]:
        """Load a PEFT directory into every engine as ``name`` (one that has it already is fine); an engine on
        another host loads a copy staged on its disk (rollout/adapter_staging.py). url -> error."""
        def body(url: str) -> dict[str, Any]:
            return {"lora_name": name, "lora_path": path_for_engine(httpx.URL(url).host, name, path)}
        return self._on_each("/load_lora_adapter", body, "already loaded")

    def unload_adapter(self, name: str, timeout: float = 600.0) -> dict[str, str]:
        """Unload a LoRA adapter from every engine (each waits for its requests to finish, hence the long timeout);
        an engine without it (restarted) is fine; a copy staged on another host goes with it. url -> error."""
        errors = self._on_each("/unload_lora_adapter", lambda _: {"lora_name": name}, "does not exist", timeout)
        for url in self.urls():
            if url not in errors:
                try:
                    unstage_for_engine(httpx.URL(url).host, name)
                except RuntimeError as e:  # the node is gone: so are its files
                    errors[url] = repr(e)
        return errors

    def _on_each(self, path: str, body: Callable[[str], dict[str, Any]], fine: str, timeout: float | None = None
                 ) -> dict[str, str]:
        """``path`` on every engine; url -> error, except refusals that say ``fine`` (the state asked for holds)."""
        errors: dict[str, str] = {}
        for url in self.urls():
            try:
                r = self._client.post(f"{url}{path}", json=body(url),
                                      **({"timeout": timeout} if timeout is not None else {}))
            except (httpx.HTTPError, OSError, RuntimeError) as e:  # RuntimeError: its host could not be staged on
                errors[url] = repr(e)
                continue
            if r.status_code != 200 and fine not in r.text:
                errors[url] = r.text[:300]
        return errors

    def close(self) -> None:
        self._client.close()
