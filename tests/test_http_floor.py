"""The HTTP floor (actorproxy/http/) knows bytes and ASGI and nothing of the proxy above it."""

from __future__ import annotations

import ast
from pathlib import Path

import actorproxy.http

FLOOR = Path(actorproxy.http.__file__).parent


def _imports(path: Path) -> list[str]:
    """The modules ``path`` imports, relative ones made absolute."""
    package = "actorproxy.http"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = f"{base}.{node.module}" if base and node.module else base or node.module or ""
            found.append(module)
    return found


def test_the_floor_imports_nothing_of_the_proxy_above_it() -> None:
    above = {str(path.relative_to(FLOOR)): [m for m in _imports(path) if m.startswith("actorproxy")
                                            and not m.startswith("actorproxy.http")]
             for path in sorted(FLOOR.glob("*.py"))}
    assert {name: modules for name, modules in above.items() if modules} == {}
    assert len(above) >= 8  # h1, errors, client, sockets, oneshot, sse, server, cycle (and the package)


def test_nothing_outside_the_floor_uses_its_private_names() -> None:
    root = FLOOR.parent
    users = []
    for path in root.rglob("*.py"):
        if path.parent == FLOOR:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("http", "actorproxy.http")):
                users += [f"{path.relative_to(root)}: {alias.name}" for alias in node.names
                          if alias.name.startswith("_")]
    assert users == []
