"""The pinned SGLang release's own source, for the contract test (tests/test_sglang_contract.py).

Why the real wheel: our CPU engine, gateway and trainer must speak SGLang's exact HTTP API, and the only
ground truth is SGLang's code. The wheel is fetched once with ``pip download`` into
``~/.cache/slime-server/sglang-<version>/`` and only the few files we read are extracted. The ``sglang``
package is never imported (it needs CUDA): files are parsed with ``ast``, and the one self-contained
module (``api/v1/api_types.py``, which needs only ``msgspec``) is loaded by path.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

SGLANG_VERSION = "0.5.23"
CACHE_DIR = Path.home() / ".cache" / "slime-server" / f"sglang-{SGLANG_VERSION}"

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
API_TYPES = "sglang/api/v1/api_types.py"
COMMON = "sglang/srt/utils/common.py"
TENSOR_BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
AUTH = "sglang/srt/utils/auth.py"
PATCH_TORCH = "sglang/srt/utils/patch_torch.py"
V1_LOADS = "sglang/srt/entrypoints/v1_loads.py"
LOAD_SNAPSHOT = "sglang/srt/managers/load_snapshot.py"
NEEDED = (HTTP_SERVER, IO_STRUCT, API_TYPES, COMMON, TENSOR_BUCKET, AUTH, PATCH_TORCH, V1_LOADS, LOAD_SNAPSHOT)

# The files we read are pure Python, identical in every wheel of a release: ask for one fixed tag so the
# download does not depend on the interpreter running the tests.
_PIP_TAG_ARGS = ("--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                 "--implementation", "cp")


class SGLangSourceError(RuntimeError):
    """The pinned wheel could not be obtained or does not hold what the contract test reads."""


def _wheel() -> Path:
    """The cached wheel, downloaded on first use (never skipped: CI has PyPI access)."""
    found = sorted(CACHE_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               *_PIP_TAG_ARGS, f"sglang=={SGLANG_VERSION}", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(Path(tmp).glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise SGLangSourceError(
                f"could not download the SGLang {SGLANG_VERSION} wheel that the contract test checks "
                f"against (needs PyPI access).\n$ {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        dest = CACHE_DIR / wheels[0].name
        os.replace(wheels[0], dest)  # atomic: a concurrent run sees a whole wheel or none
    return dest


def sglang_file(relpath: str) -> Path:
    """Path of one file of the pinned release (extracted from the cached wheel on first use)."""
    out = CACHE_DIR / "src" / relpath
    if out.is_file():
        return out
    wheel = _wheel()
    with zipfile.ZipFile(wheel) as zf:
        try:
            data = zf.read(relpath)
        except KeyError:
            raise SGLangSourceError(f"{wheel.name} has no {relpath}: did SGLang move it?") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out


@cache
def _tree(relpath: str) -> tuple[str, ast.Module]:
    src = sglang_file(relpath).read_text(encoding="utf-8")
    return src, ast.parse(src, filename=relpath)


# ---------------------------------------------------------------- http_server.py: routes

_VERB_DECORATORS = {"get", "post", "put", "delete", "patch", "head", "options"}


def _route_path(node: ast.expr) -> str | None:
    """A route path literal, or the default of ``os.environ.get("VAR", "/path")``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)):
        return str(node.args[1].value)
    return None


@cache
def http_routes() -> dict[str, frozenset[str]]:
    """Every ``@app.<verb>(path)`` / ``@app.api_route(path, methods=[...])`` route: path -> HTTP methods.

    Walks every function (routes are also declared inside ``if`` blocks and nested functions) and every
    decorator of it (routes are stacked, e.g. ``/health`` and ``/health_generate`` on one function).
    """
    _, tree = _tree(HTTP_SERVER)
    routes: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app" and dec.args):
                continue
            path = _route_path(dec.args[0])
            if path is None:
                continue
            verb = dec.func.attr
            if verb in _VERB_DECORATORS:
                methods = {verb.upper()}
            elif verb == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = set(ast.literal_eval(kw["methods"])) if "methods" in kw else {"GET"}  # FastAPI default
            else:
                continue
            routes.setdefault(path, set()).update(m.upper() for m in methods)
    return {p: frozenset(m) for p, m in routes.items()}


@cache
def route_auth_levels() -> dict[str, str]:
    """Route path -> the ``AuthLevel`` member its function is decorated with (``NORMAL`` when undecorated)."""
    _, tree = _tree(HTTP_SERVER)
    levels: dict[str, str] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        level = "NORMAL"
        for dec in fn.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id == "auth_level"
                    and dec.args and isinstance(dec.args[0], ast.Attribute)):
                level = dec.args[0].attr
        for dec in fn.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr != "exception_handler"
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app" and dec.args):
                path = _route_path(dec.args[0])
                if path is not None:
                    levels[path] = level
    return levels


# ---------------------------------------------------------------- io_struct.py: request classes


def _is_classvar(ann: ast.expr) -> bool:
    target = ann.value if isinstance(ann, ast.Subscript) else ann
    return (isinstance(target, ast.Name) and target.id == "ClassVar") or (
        isinstance(target, ast.Attribute) and target.attr == "ClassVar")


def _required(value: ast.expr | None) -> bool:
    """No default: a bare annotation, or ``field(...)`` / ``msgspec.field(...)`` without a default."""
    if value is None:
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name == "field":
            return not {k.arg for k in value.keywords} & {"default", "default_factory"}
    return False


@cache
def _io_struct_values() -> dict[str, dict[str, ast.expr | None]]:
    """Each class of io_struct.py -> {field: default expression or None}, inherited fields included."""
    _, tree = _tree(IO_STRUCT)
    own: dict[str, dict[str, ast.expr | None]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        own[node.name] = {
            st.target.id: st.value
            for st in node.body
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and not _is_classvar(st.annotation)
        }
        bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def resolve(name: str, seen: tuple[str, ...] = ()) -> dict[str, ast.expr | None]:
        fields: dict[str, ast.expr | None] = {}
        for base in bases.get(name, []):
            if base in own and base not in seen:
                fields.update(resolve(base, (*seen, name)))
        fields.update(own.get(name, {}))
        return fields

    return {name: resolve(name) for name in own}


def io_struct_classes() -> dict[str, dict[str, bool]]:
    """Each class of io_struct.py -> {field: required}, inherited fields (e.g. ``BaseReq``'s) included."""
    return {cls: {f: _required(v) for f, v in fields.items()} for cls, fields in _io_struct_values().items()}


_NO_LITERAL = object()


def _literal(value: ast.expr | None) -> object:
    try:
        return ast.literal_eval(value) if value is not None else _NO_LITERAL
    except ValueError:
        return _NO_LITERAL


def io_struct_defaults() -> dict[str, dict[str, object]]:
    """Each class of io_struct.py -> {field: default} for the fields whose default is a plain literal."""
    return {cls: {f: d for f, v in fields.items() if (d := _literal(v)) is not _NO_LITERAL}
            for cls, fields in _io_struct_values().items()}


# ---------------------------------------------------------------- self-contained modules, loaded by path


@cache
def load_by_path(relpath: str) -> ModuleType:
    """One self-contained file of the release as a module of its own (never the ``sglang`` package):
    ``api/v1/api_types.py`` imports only typing and msgspec, ``weight_sync/tensor_bucket.py`` only torch."""
    name = f"_sglang_{SGLANG_VERSION.replace('.', '_')}_{Path(relpath).stem}"
    spec = importlib.util.spec_from_file_location(name, sglang_file(relpath))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec and dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def api_types() -> ModuleType:
    """SGLang's generated ``/generate`` JSON contract (``GenerateRequest``, ``GenerateResponse``, ...)."""
    return load_by_path(API_TYPES)


# ---------------------------------------------------------------- utils/common.py: unpickler, process group


def _class_node(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SGLangSourceError(f"class {name} not found")


@cache
def safe_unpickler_allowed_globals() -> frozenset[tuple[str, str]]:
    """``SafeUnpickler.ALLOWED_GLOBALS``: the (module, name) pairs a weight payload may reference."""
    _, tree = _tree(COMMON)
    for st in _class_node(tree, "SafeUnpickler").body:
        if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ALLOWED_GLOBALS"
                                              for t in st.targets):
            return frozenset(ast.literal_eval(st.value))
    raise SGLangSourceError("SafeUnpickler.ALLOWED_GLOBALS not found")


@cache
def safe_unpickler_class() -> type:
    """SGLang's ``SafeUnpickler`` itself, exec'd from common.py with the one helper it calls."""
    import io
    import pickle

    import torch

    src, tree = _tree(COMMON)
    parts = [function_source(COMMON, "_safe_load_torch_storage"),
             ast.get_source_segment(src, _class_node(tree, "SafeUnpickler"))]
    ns: dict[str, object] = {"io": io, "pickle": pickle, "torch": torch, "__name__": "sglang_safe_unpickler"}
    exec(compile("\n\n".join(p for p in parts if p), f"{COMMON}:SafeUnpickler", "exec"), ns)
    return ns["SafeUnpickler"]  # type: ignore[return-value]


@cache
def torch_reductions_patch() -> Callable[[], None]:
    """SGLang's ``monkey_patch_torch_reductions`` (what its model runner applies before it unpickles CUDA
    payloads: devices by UUID), exec'd from patch_torch.py with the helpers it calls (NPU branches off). Call what
    it returns to apply the patch."""
    from typing import Union

    import torch
    from torch.multiprocessing import reductions

    src, tree = _tree(PATCH_TORCH)
    names = ("monkey_patch_torch_reductions", "_reduce_tensor_modified", "_rebuild_cuda_tensor_modified",
             "_device_to_uuid", "_device_from_maybe_uuid", "_modify_tuple")
    constants = [ast.get_source_segment(src, node) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "_REDUCE_TENSOR_ARG_DEVICE_INDEX" for t in node.targets)]
    if len(constants) != 1:
        raise SGLangSourceError("_REDUCE_TENSOR_ARG_DEVICE_INDEX not found in patch_torch.py")
    ns: dict[str, object] = {"torch": torch, "reductions": reductions, "Callable": Callable, "Union": Union,
                             "_is_npu": False, "__name__": "sglang_patch_torch"}
    code = "\n\n".join([constants[0] or "", *(function_source(PATCH_TORCH, n) for n in names)])
    exec(compile(code, PATCH_TORCH, "exec"), ns)
    return ns["monkey_patch_torch_reductions"]  # type: ignore[return-value]


def function_source(relpath: str, name: str) -> str:
    """Source text of one top-level function of a file of the release (to exec test-side)."""
    src, tree = _tree(relpath)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            seg = ast.get_source_segment(src, node)
            assert seg is not None
            return seg
    raise SGLangSourceError(f"function {name} not found in {relpath}")


def class_fields(relpath: str, name: str) -> set[str]:
    """The annotated fields of one top-level class of a file of the release (a msgspec Struct, a dataclass)."""
    _, tree = _tree(relpath)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {st.target.id for st in node.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    raise SGLangSourceError(f"class {name} not found in {relpath}")


def loads_route() -> tuple[str, set[str]]:
    """``v1_loads.py``'s ``@router.get(path)`` route: its path and the keys of the dict it returns."""
    _, tree = _tree(V1_LOADS)
    for fn in tree.body:
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for dec in fn.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "get"
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "router" and dec.args):
                returned = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)]
                keys = {k.value for d in returned for k in d.keys if isinstance(k, ast.Constant)}
                return str(ast.literal_eval(dec.args[0])), keys
    raise SGLangSourceError(f"no @router.get route in {V1_LOADS}")


def fetch_all() -> None:
    """Download and extract everything the contract test reads (turns a network failure into one error)."""
    for rel in NEEDED:
        sglang_file(rel)
