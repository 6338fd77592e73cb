"""The package's shape, checked: no import circle inside ``slime_server`` and no module over 600 lines.

Every import counts, those inside functions too (an import moved into a function to dodge a circle still
ties the two modules together); only ``if TYPE_CHECKING:`` blocks are left out, as they never run. The
walk is the standard library's ``ast``, resolved to the package's own modules, and Tarjan's algorithm
names every circle it finds."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slime_server"
MAX_LINES = 600


@functools.cache
def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(name: str) -> str | None:
    """The package module ``name`` is, or is inside (``pkg.mod.attr`` -> ``pkg.mod``); None outside the package."""
    mods = _modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(mod: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Dotted names ``node`` (in ``mod``) imports: relative imports anchored, and ``from pkg import mod``
    naming the module ``pkg.mod`` rather than ``pkg``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    mods = _modules()
    package = mod if mods[mod].name == "__init__.py" else mod.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import mod`` counts as importing ``mod``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(mod, node):
                if target.split(".")[0] == "slime_server" and (t := _resolve(target)) and t != mod:
                    graph[mod].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_walk_sees_imports_inside_functions() -> None:
    graph = import_graph()
    assert "slime_server.buffer.open" in graph["slime_server.buffer.keys_cli"]
    # serve_cmd imports launch only inside start_server (ray is heavy): still an edge
    assert "slime_server.server.launch" in graph["slime_server.server.serve_cmd"]


def test_packages_import_each_other_one_way() -> None:
    """No two packages (or top-level modules) import each other, even through different modules: the
    tree reads as layers (README's package map)."""
    def package(mod: str) -> str:
        return mod.split(".")[1] if "." in mod else mod

    ties = {(package(m), package(d)) for m, deps in import_graph().items() for d in deps if package(m) != package(d)}
    assert not {(a, b) for a, b in ties if (b, a) in ties}


def test_no_import_circle_inside_the_package() -> None:
    found = circles(import_graph())
    assert not found, "import circles (each list imports itself round): " + "; ".join(" -> ".join(c) for c in found)


def test_no_module_over_600_lines() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _third_party(mod: str) -> set[str]:
    """Top-level names of what ``mod`` imports from outside the package (inside functions too)."""
    path = _modules()[mod]
    names: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - {"slime_server"}


def test_the_gateway_core_is_below_http() -> None:
    """``gateway/`` (and everything it reaches in the package) imports no HTTP framework and nothing of
    ``api/``; only commands (``slime-server serve``, ``demo``, ``train --local``) import ``server/``."""
    graph = import_graph()
    core = {m for m in graph if m.startswith("slime_server.gateway")}
    reached, todo = set(core), list(core)
    while todo:
        for dep in graph[todo.pop()] - reached:
            reached.add(dep)
            todo.append(dep)
    http = {m: sorted(_third_party(m) & {"fastapi", "starlette", "uvicorn", "sse_starlette"}) for m in reached}
    assert not {m: h for m, h in http.items() if h}, "the gateway core reaches an HTTP framework"
    assert {m for m in reached if m.startswith("slime_server.api")} == set()
    assert {m for m in reached if m.startswith("slime_server.server")} == set()
    importers = {m for m, deps in graph.items() if any(d.startswith("slime_server.server") for d in deps)}
    assert {m for m in importers if not m.startswith("slime_server.server")} <= {
        "slime_server.demo"}, importers  # the other commands are in server/ (cli.py names them as strings)


# What an import inside a function may put off: a dependency that costs seconds or memory to load, is an
# optional extra, or is the HTTP layer (the core and the trainer must not load it for nothing).
_DEFERRABLE = {"torch", "megatron", "ray", "transformers", "tokenizers", "safetensors", "gguf", "accelerate",
               "psycopg", "sglang", "sglang_router", "transformer_engine", "matplotlib", "pyarrow", "wandb",
               "tensorboardX", "mcp", "openai", "jinja2", "fastapi", "starlette", "uvicorn", "verifiers", "datasets"}


def _top_and_deferred(mod: str) -> tuple[set[str], set[str], list[ast.ImportFrom]]:
    """(our modules ``mod`` imports at import time, third-party names it loads then, our modules it imports
    inside functions). Class bodies run at import time; function bodies do not."""
    path = _modules()[mod]
    ours: set[str] = set()
    third: set[str] = set()
    deferred: list[ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if _type_checking_only(node):
            for child in node.orelse:  # type: ignore[attr-defined]
                visit(child, in_function)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = _targets(mod, node)
            if in_function:
                if isinstance(node, ast.ImportFrom) and any(n.startswith("slime_server.") for n in names):
                    deferred.append(node)
                return
            for name in names:
                if name.startswith("slime_server."):
                    if target := _resolve(name):
                        ours.add(target)
                else:
                    third.add(name.split(".")[0])
            return
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return ours, third, deferred


def test_an_import_inside_a_function_defers_something_heavy_and_says_what() -> None:
    """An import of our own module inside a function must put off loading a dependency from
    ``_DEFERRABLE`` that the importing module does not load at import time, and say which in a comment on
    its line; any other belongs at the top (there is no import circle to dodge), without that comment."""
    mods = _modules()
    parts = {m: _top_and_deferred(m) for m in mods}
    loads: dict[str, set[str]] = {}

    def loaded(mod: str) -> set[str]:
        if mod not in loads:
            seen, todo, names = {mod}, [mod], set()
            while todo:
                ours, third, _ = parts[todo.pop()]
                names |= third
                todo.extend(o for o in ours - seen)
                seen |= ours
            loads[mod] = names
        return loads[mod]

    needless, silent, stale = [], [], []
    for mod, (_, _, deferred) in parts.items():
        lines = mods[mod].read_text().splitlines()
        stale += [f"{mod}:{n.lineno}" for n in ast.parse("\n".join(lines)).body
                  if isinstance(n, ast.Import | ast.ImportFrom) and "# lazy: " in lines[n.lineno - 1]]
        for node in deferred:
            target = _resolve(node.module or "") or ""
            extra = (loaded(target) - loaded(mod)) & _DEFERRABLE
            where = f"{mod}:{node.lineno} ({node.module})"
            if not extra:
                needless.append(where)
            elif "# lazy: " not in lines[node.lineno - 1]:
                silent.append(f"{where} defers {sorted(extra)}")
    assert not needless, "imports inside functions that defer nothing heavy (move them to the top): " + ", ".join(
        needless)
    assert not silent, "deferred imports without a '# lazy: ...' comment: " + ", ".join(silent)
    assert not stale, "top-level imports that say they are deferred: " + ", ".join(stale)


def test_a_job_spec_and_the_jobs_commands_load_no_torch() -> None:
    """``slime-server train`` / ``jobs`` are REST clients: validating a job spec must not load torch or
    Megatron (it did, through the trainer modules that held the settings: ~3 s and ~200 MB per command)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import slime_server.server.jobs_cmd\n"
            "from slime_server.jobs.spec import JobSpec\n"
            "JobSpec.model_validate({'loss': {'loss_type': 'ppo'}, 'critic': {}, 'loop': {'batch_size': 4}})\n"
            "print(sorted(m for m in ('torch', 'megatron', 'ray') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
