"""The gateway's core: what a turn does, without HTTP.

Chat templating, tool-call and reasoning parsers, sessions (token-exact multi-turn assembly),
partial rollouts, the engine client, recording into the store, pacing, and the turn itself. No
FastAPI or Starlette import here (``tests/test_import_graph.py`` checks it): ``api/`` is the thin
HTTP layer over this package, and ``server/`` wires both to the engines and the trainer.
"""
