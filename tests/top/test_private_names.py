"""No private name is used across modules: a leading underscore means "this module's own".

Read from the source (AST), over every module of ``actorproxy/``. A module may not:

- import a name with a leading underscore from another of our modules
  (``from .http_server import _Connection``);
- read one through a module it imported (``serve._drain``);
- reach into another module's objects for a private attribute that this module
  does not define itself (``self._engine._clock``, ``generation._kick()``): the
  other module's class keeps it to itself. A class's own ``self._x`` (its own or
  its base class's) is its business.

Dunder names (``__init__``, ``__all__``) are public; names of other projects
(``os._exit``) are theirs.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "actorproxy"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source(module: str, level: int, here: str, package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in module ``here``."""
    if level == 0:
        return module
    base = here.split(".") if package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def _is_own(owner: ast.expr) -> bool:
    """Whether ``owner`` is the instance or class a method is about (``self``, ``cls``)."""
    return isinstance(owner, ast.Name) and owner.id in ("self", "cls")


def _defined(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, assigned names, its objects' own attributes (``self.x =``),
    arguments, slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_own(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # __slots__, attrs aliases
            names.add(node.value)
    return names


@functools.cache
def private_uses(root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """(module path, line, private name, what the code says) for each private name used across the modules
    of the package at ``root``."""
    files = sorted(root.rglob("*.py"))
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    modules = {_module_name(root, path) for path in files}
    defined = {path: _defined(tree) for path, tree in trees.items()}
    defined_anywhere: dict[str, set[Path]] = defaultdict(set)
    for path, names in defined.items():
        for name in names:
            defined_anywhere[name].add(path)
    found = []
    for path, tree in trees.items():
        here = _module_name(root, path)
        shown = str(path.relative_to(root.parent))
        imported_modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _source(node.module or "", node.level, here, path.name == "__init__.py")
                if source.split(".")[0] != "actorproxy":
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        imported_modules.add(alias.asname or alias.name)
                    elif _private(alias.name):
                        found.append((shown, node.lineno, alias.name, f"from {source} import {alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "actorproxy":
                        imported_modules.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in imported_modules:
                found.append((shown, node.lineno, node.attr, ast.unparse(node)))
            elif _is_own(owner):
                continue
            elif node.attr not in defined[path] and defined_anywhere[node.attr] - {path}:
                found.append((shown, node.lineno, node.attr, ast.unparse(node)))
    return sorted(found)


def test_no_private_name_is_used_across_modules() -> None:
    found = private_uses()
    assert found == [], "\n".join(f"{path}:{line}: {text}" for path, line, _, text in found)


def test_each_kind_of_use_is_found(tmp_path: Path) -> None:
    """The checker itself: an import, a module's attribute and another module's object's attribute are found."""
    package = tmp_path / "actorproxy"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("_SECRET = 1\nclass _Hidden:\n    def _poke(self) -> None:\n"
                                         "        self._set = 0\n")
    (package / "sub" / "b.py").write_text(
        "from . import a\nfrom .a import _SECRET\nfrom actorproxy.sub.a import _Hidden\n"
        "x = a._SECRET\n"
        "def f(thing: object) -> None:\n    thing._poke()\n    thing._set = 1\n"
        "class Own:\n    def _mine(self) -> None:\n        self._mine()\n        other = Own()\n        other._mine()\n"
        "        self._set = 2\n"
    )
    (package / "c.py").write_text("def g(thing: object) -> None:\n    thing._set = 1\n")
    found = {(path, name) for path, _, name, _ in private_uses(package)}
    b = "actorproxy/sub/b.py"
    # Not b's "_set": b's own class sets it too. c sets another module's.
    assert found == {(b, "_SECRET"), (b, "_Hidden"), (b, "_poke"), ("actorproxy/c.py", "_set")}
