"""The pinned SGLang release's own code, as tests/contracts/test_sglang_contract.py reads it.

``scripts/sglang/install.sh`` unpacks the release's Python source (the PyPI wheel, no
dependencies) into ``~/.cache/actorproxy/sglang-src-<version>``. SGLang's modules import
torch, zmq and its kernels, so they are not imported whole; the contract takes from them:

* :meth:`SGLangSource.module`: a file with no heavy imports, imported as it is (the
  generated JSON contract ``sglang/api/v1/api_types.py``, the parser name lists).
* :meth:`SGLangSource.definitions`: named top-level classes, functions and assignments of
  a file, executed in a module of their own with the names they use from elsewhere given
  (``io_struct.py``'s request structs, ``sampling_params.py``'s ``SamplingParams``, the
  finish reasons of ``schedule_batch.py``). A name neither defined there nor given is
  bound to ``typing.Any`` and listed in the module's ``__stubbed__``, so a check can see
  that nothing it relies on was stubbed.
* :meth:`SGLangSource.routes`: every route of ``http_server.py``, from its decorators, with
  the methods and the type its body is parsed into.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import importlib.util
import itertools
import os
import subprocess
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

SGLANG_VERSION = "0.5.23"
INSTALL = Path(__file__).resolve().parents[1] / "scripts" / "sglang" / "install.sh"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"

_counter = itertools.count()


def install() -> SGLangSource | str:
    """The unpacked source (installed now when missing), or why it cannot be had."""
    env = {**os.environ, "PYTHON": sys.executable}
    try:
        done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, env=env, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scripts/sglang/install.sh could not run: {exc}"
    if done.returncode != 0:
        return f"scripts/sglang/install.sh failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}"
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return SGLangSource(Path(paths["source"]))


@attrs.frozen
class Route:
    method: str
    path: str
    handler: str
    #: The class the JSON body is parsed into (``None``: the handler reads no body).
    body: str | None


class SGLangSource:
    def __init__(self, root: Path) -> None:
        self.root = root

    def text(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8")

    def version(self) -> str:
        (metadata,) = self.root.glob("sglang-*.dist-info/METADATA")
        for line in metadata.read_text(encoding="utf-8").splitlines():
            if line.startswith("Version: "):
                return line.removeprefix("Version: ").strip()
        raise AssertionError(f"{metadata} names no version")

    def module(self, rel: str) -> types.ModuleType:
        """``rel`` imported as it is (it must import nothing SGLang's environment alone has)."""
        name = f"_sglang_contract_{next(_counter)}"
        spec = importlib.util.spec_from_file_location(name, self.root / rel)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # msgspec and pydantic resolve string annotations through it
        spec.loader.exec_module(module)
        return module

    def definitions(
        self, rel: str, names: Iterable[str] | None = None, given: Mapping[str, Any] = {}, *,
        fields_only: Iterable[str] = (),
    ) -> types.ModuleType:
        """The top-level definitions ``names`` of ``rel`` (``None``: all but its imports), run in file order
        in a module of their own.

        ``given``: the names they use that ``rel`` imports. Classes in ``fields_only`` keep
        their fields and lose their methods (for a dataclass whose methods need the rest of
        SGLang; the fields are what a request body is checked against).
        """
        strip = set(fields_only)
        picked: list[ast.stmt] = []
        wanted = None if names is None else set(names)
        for node in ast.parse(self.text(rel), filename=rel).body:
            name = _defined_name(node)
            if name is None or (wanted is not None and name not in wanted):
                continue
            if wanted is not None:
                wanted.discard(name)
            if name in strip and isinstance(node, ast.ClassDef):
                node.body = [s for s in node.body if not isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)]
                node.body = node.body or [ast.Pass()]
            picked.append(node)
        assert not wanted, f"{rel} of sglang {SGLANG_VERSION} defines no {sorted(wanted)}"
        return self._run(rel, picked, given)

    def methods(self, rel: str, cls: str, names: Iterable[str], given: Mapping[str, Any] = {}) -> types.ModuleType:
        """Methods of ``cls`` in ``rel`` as plain functions of a module (``self`` is the caller's to pass)."""
        wanted = set(names)
        for node in ast.parse(self.text(rel), filename=rel).body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                picked = [
                    f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name in wanted
                ]
                for function in picked:
                    function.decorator_list = []
                missing = wanted - {f.name for f in picked}
                assert not missing, f"{cls} of sglang {SGLANG_VERSION} has no {sorted(missing)}"
                return self._run(rel, list(picked), given)
        raise AssertionError(f"{rel} defines no class {cls}")

    def _run(self, rel: str, picked: list[ast.stmt], given: Mapping[str, Any]) -> types.ModuleType:
        module = types.ModuleType(f"_sglang_contract_{next(_counter)}")
        namespace = module.__dict__
        namespace.update({n: getattr(typing, n) for n in typing.__all__})
        namespace.update(given)
        defined = {_defined_name(node) for node in picked}
        stubbed = sorted(
            n for n in _names_used(picked) if n not in namespace and n not in defined and not hasattr(builtins, n)
        )
        namespace.update(dict.fromkeys(stubbed, Any))
        namespace["__stubbed__"] = stubbed
        sys.modules[module.__name__] = module
        code = compile(
            ast.Module(body=picked, type_ignores=[]), str(self.root / rel), "exec",
            flags=__future__.annotations.compiler_flag, dont_inherit=True,
        )
        exec(code, namespace)
        return module

    def class_fields(self, rel: str, cls: str) -> dict[str, str]:
        """The annotated fields of ``cls`` in ``rel`` (with its annotation's source), bases not included."""
        text = self.text(rel)
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return {
                    s.target.id: ast.get_source_segment(text, s.annotation) or ""
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
        raise AssertionError(f"{rel} defines no class {cls}")

    def routes(self) -> dict[tuple[str, str], Route]:
        """``(method, path)`` -> :class:`Route`, for every route ``http_server.py`` declares."""
        found: dict[tuple[str, str], Route] = {}
        for node in ast.walk(ast.parse(self.text(HTTP_SERVER))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for decorator in node.decorator_list:
                for method, path in _route_of(decorator):
                    found[(method, path)] = Route(method, path, node.name, _body_type(node))
        return found


def _defined_name(node: ast.stmt) -> str | None:
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _names_used(nodes: list[ast.stmt]) -> set[str]:
    """Every free-looking name in ``nodes``, string annotations included (over-approximated)."""
    used: set[str] = set()
    for top in nodes:
        for node in ast.walk(top):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                used.add(node.id)
            elif isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
                used |= _names_in_annotation(node.annotation)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
                used |= _names_in_annotation(node.returns)
        # Locals and parameters are not free: a function's own names are left to Python.
        for node in ast.walk(top):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                used -= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
                used -= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return used


def _names_in_annotation(annotation: ast.expr) -> set[str]:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}


_VERBS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}


def _route_of(decorator: ast.expr) -> list[tuple[str, str]]:
    """``@app.post("/x")``, ``@app.api_route("/x", methods=[...])``; a path from the environment: its default."""
    if not (
        isinstance(decorator, ast.Call)
        and isinstance(decorator.func, ast.Attribute)
        and isinstance(decorator.func.value, ast.Name)
        and decorator.func.value.id == "app"
        and decorator.args
    ):
        return []
    path = _path(decorator.args[0])
    verb = decorator.func.attr
    if path is None:
        return []
    if verb in _VERBS:
        return [(_VERBS[verb], path)]
    if verb == "api_route":
        methods = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
        if isinstance(methods, ast.List | ast.Tuple):
            return [(m.value, path) for m in methods.elts if isinstance(m, ast.Constant) and isinstance(m.value, str)]
        return [("GET", path)]
    return []


def _path(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and len(node.args) == 2:  # os.environ.get("NAME", "/default")
        return _path(node.args[1])
    return None


def _body_type(handler: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The class a handler's body is parsed into: its first parameter typed with a class of ours."""
    for arg in handler.args.args:
        annotation = arg.annotation
        if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
            if annotation.value.id == "Annotated" and isinstance(annotation.slice, ast.Tuple):
                annotation = annotation.slice.elts[0]
            elif annotation.value.id == "Optional":
                annotation = annotation.slice
        if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
            if annotation.value.id == "Optional":
                annotation = annotation.slice
        if isinstance(annotation, ast.Name) and annotation.id not in ("Request", "WebSocket", "str", "int", "float"):
            return annotation.id
    return None
