"""The package's import graph has no loops, and its floors stay floors.

The floors, lowest first (a module may import from its own floor and the floors below it, never above):

1. ``http``: bytes and ASGI; knows nothing else of actorproxy.
2. ``errors``, ``telemetry``, ``logs``, ``serving``, ``session_meta``, ``trajectory_file``, ``rewards``,
   ``same_named``, ``closing``, ``generations``: the leaf modules every floor may use.
3. ``config``: the settings tree.
4. ``tokenization``: tokenizers, chat templates, message fields.
5. ``core``: the sans-IO heart: requests, turn events, parsing, TITO, records.
6. ``schema``: the one cattrs converter, the records' wire form, JSON body loading, prefix tables.
7. ``engines``: the clients of SGLang, vLLM and llama.cpp, each with its wire protocol.
8. ``sim``: the built-in simulated engine, with each engine kind's simulated routes (speaking that protocol).
9. ``store``: where finished trajectories are kept (and ``reward_worker``, which reaches Ray through it).
10. ``runtime``: the actors: registry, sessions, controller.
11. ``protocols``: the agent protocols (chat, Anthropic, Responses, gateway, trainer bodies).
12. ``server``: the HTTP routes.
13. ``serve``, ``startup``: one proxy process, put together.
14. ``workers``: the multi-process front (each worker runs ``serve``).
15. the other top-level modules (``cli``, ``client``, ``embed``, ``testing``, ...).

Only imports run when a module is imported count (module level, outside ``if TYPE_CHECKING``);
an import inside a function is a deliberate late binding, allowed only where a real cycle would otherwise
exist: a comment on its line or the line above says so (``cycle``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import actorproxy

PACKAGE = Path(actorproxy.__file__).parent


def module_imports(package: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports at module level."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: None if is_package else -1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    if submodule in modules:
                        graph[name].add(submodule)
                    elif target in modules:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in modules)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(start: str) -> None:  # iterative Tarjan: the graph is deep enough to matter
        work = [(start, iter(sorted(graph[start])))]
        order[start] = low[start] = len(order)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in order:
                    order[child] = low[child] = len(order)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], order[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in order:
            visit(name)
    return cycles


#: The floors, lowest first: each a list of module-name prefixes (see the module docstring).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("actorproxy.http",),
    (
        "actorproxy.errors",
        "actorproxy.telemetry",
        "actorproxy.logs",
        "actorproxy.serving",
        "actorproxy.session_meta",
        "actorproxy.trajectory_file",
        "actorproxy.rewards",
        "actorproxy.same_named",
        "actorproxy.closing",
        "actorproxy.generations",
    ),
    ("actorproxy.config",),
    ("actorproxy.tokenization",),
    ("actorproxy.core",),
    ("actorproxy.schema",),
    ("actorproxy.engines",),
    ("actorproxy.sim",),
    ("actorproxy.store", "actorproxy.reward_worker"),
    ("actorproxy.runtime",),
    ("actorproxy.protocols",),
    ("actorproxy.server",),
    ("actorproxy.serve", "actorproxy.startup"),
    ("actorproxy.workers",),
)


def floor_of(module: str, floors: tuple[tuple[str, ...], ...] = FLOORS) -> int:
    """The index of ``module``'s floor; the top-level modules not named in a floor are above them all."""
    for index, prefixes in enumerate(floors):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    return len(floors)


def upward_imports(
    graph: dict[str, set[str]], floors: tuple[tuple[str, ...], ...] = FLOORS
) -> list[tuple[str, str]]:
    """Every (importer, imported) pair where the imported module sits on a higher floor than its importer."""
    return sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if floor_of(target, floors) > floor_of(name, floors)
    )


def test_no_module_imports_from_a_floor_above_it() -> None:
    graph = module_imports(PACKAGE)
    assert upward_imports(graph) == []


def test_every_floor_is_a_real_package_or_module() -> None:
    modules = set(module_imports(PACKAGE))
    missing = [prefix for prefixes in FLOORS for prefix in prefixes if prefix not in modules]
    assert missing == []


def test_the_floor_check_finds_an_upward_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for sub in ("low", "high"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("from ..high import b\n\ndef late():\n    from ..high import c\n")
    (package / "high" / "b.py").write_text("from ..low import a\n")
    (package / "high" / "c.py").write_text("")
    (package / "top.py").write_text("from .high import c\n")
    floors = (("pkg.low",), ("pkg.high",))
    graph = module_imports(package)
    assert upward_imports(graph, floors) == [("pkg.low.a", "pkg.high.b")]
    assert floor_of("pkg.top", floors) == 2


def late_imports(package: Path) -> list[str]:
    """``path:line`` of each import of the package inside a function without a comment naming the ``cycle``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for function in ast.walk(ast.parse(text)):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                ours = isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package.name))
                said = "cycle" in " ".join(lines[max(node.lineno - 2, 0) : node.lineno]) if ours else True
                if not said:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_an_import_inside_a_function_says_which_cycle_it_breaks() -> None:
    assert late_imports(PACKAGE) == []


def test_the_late_import_check_finds_one(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "def f():\n    from . import b\n\n\ndef g():\n    # a cycle: b imports this module\n    from . import b\n"
    )
    assert late_imports(package) == ["pkg/a.py:2"]


def test_no_module_level_import_cycles_in_actorproxy() -> None:
    graph = module_imports(PACKAGE)
    assert len(graph) > 100  # the walk really found the package
    assert sum(len(targets) for targets in graph.values()) > 300
    assert import_cycles(graph) == []


def test_the_check_finds_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import thing as thing\n")
    (package / "a.py").write_text("from .sub import thing\n")
    (package / "sub" / "b.py").write_text("from ..a import x\n\ndef late():\n    from .. import c\n")
    (package / "c.py").write_text("import pkg.sub.b\n")
    graph = module_imports(package)
    assert graph["pkg.a"] == {"pkg.sub"}
    assert graph["pkg.sub.b"] == {"pkg.a"}  # the import inside late() does not count
    assert import_cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]


def test_no_module_serves_http_through_hypercorn() -> None:
    """The project serves HTTP on its own server (``actorproxy.http.server``; docs/decisions.md), the simulated
    engine too: hypercorn is only quart-trio's dependency."""
    users = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "hypercorn" for name in names):
                users.append(str(path.relative_to(PACKAGE)))
    assert users == []
