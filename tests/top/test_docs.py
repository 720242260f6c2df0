"""The docs stay true to the tree: links, command lines, and the code they name.

Checked without starting anything but the benchmarks' ``--help``:

* every relative link in ``docs/``, ``README.md`` and ``examples/README.md`` reaches a
  file, and a ``#fragment`` into a page names one of its headings;
* every ``actorproxy run|check|sim`` command line in them uses flags that subcommand has
  (read from the CLI's own parser), and every ``python benchmarks/<name>.py`` line flags
  that benchmark has (read from its ``--help``);
* every module path a page names in backticks (``runtime/session.py``, ``benchmarks/x.py``)
  exists, and every ``module.py: name`` or ``Class.attribute`` it names is defined there:
  docs/architecture.md lists the code that makes each representation of a turn, and a
  module that moves must take the page with it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from actorproxy.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "actorproxy"
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "examples" / "README.md"])
#: Pages whose backticked module paths and names must exist (the ones that describe the code's layout).
CODE_PAGES = [ROOT / "docs" / "architecture.md", ROOT / "docs" / "decisions.md", ROOT / "docs" / "performance.md",
              ROOT / "README.md"]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+ (.*)$", re.MULTILINE)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
_COMMAND = re.compile(r"(?:^|[\s`(])(?:python3? -m )?actorproxy (run|check|sim)\b([^`\n]*(?:\\\n[^`\n]*)*)")
_BENCHMARK = re.compile(r"python3? (benchmarks/\w+\.py)\b([^`\n]*(?:\\\n[^`\n]*)*)")
_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:actorproxy/)?((?:[a-z_0-9]+/)*[a-z_0-9]+\.py)$")
_PATH_NAME = re.compile(r"((?:[a-z_0-9]+/)*[a-z_0-9]+\.py): ([A-Za-z_][\w.]*)")
_QUALIFIED = re.compile(r"^([A-Z]\w+)\.([a-z_]\w*)$")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    return frozenset(_slug(h) for h in _HEADING.findall(page.read_text(encoding="utf-8")))


def _commands(pattern: re.Pattern[str], text: str) -> list[tuple[str, list[str]]]:
    """Each command line ``pattern`` finds (continuation lines joined, comments cut): its program and its flags."""
    found = []
    for match in pattern.finditer(text):
        rest = match.group(2).replace("\\\n", " ").split(" #")[0]
        # A flag's value may itself be a flag (``--proxy-flag=--workers=2``): only a word's head counts.
        flags = [word.split("=")[0] for word in rest.split() if _FLAG.fullmatch(word.split("=")[0])]
        found.append((match.group(1), flags))
    return found


def _resolve(path: str) -> Path | None:
    """A module path as a page names it: under the package (``runtime/session.py``) or the repository."""
    for base in (PACKAGE, ROOT):
        if (base / path).is_file():
            return base / path
    return None


@cache
def _defined(module: Path) -> frozenset[str]:
    """Every name a module defines: functions, classes, their methods and attributes (``Class.name`` too)."""
    names: set[str] = set()
    tree = ast.parse(module.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node is not cls:
                names.add(f"{cls.name}.{node.name}")
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(f"{cls.name}.{node.target.id}")
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(f"{cls.name}.{node.attr}")
    return frozenset(names)


@cache
def _classes() -> dict[str, list[Path]]:
    """Class name -> the package's modules that define a class of that name."""
    found: dict[str, list[Path]] = {}
    for module in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def test_links_and_anchors_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_actorproxy_command_lines_use_its_flags() -> None:
    parser = build_parser()
    subcommands = next(a.choices for a in parser._actions if isinstance(a.choices, dict))
    options = {name: {o for action in sub._actions for o in action.option_strings} for name, sub in subcommands.items()}
    unknown = [f"{page.relative_to(ROOT)}: actorproxy {command} {flag}"
               for page in PAGES for command, flags in _commands(_COMMAND, page.read_text(encoding="utf-8"))
               for flag in flags if flag not in options[command]]
    assert not unknown, "\n".join(unknown)


def _benchmark_flags(program: str) -> set[str]:
    shown = subprocess.run([sys.executable, str(ROOT / program), "--help"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    return set(_FLAG.findall(shown.stdout))


@pytest.mark.parametrize("page", [p for p in PAGES if _BENCHMARK.search(p.read_text(encoding="utf-8"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_command_lines_use_its_flags(page: Path) -> None:
    unknown = []
    known: dict[str, set[str]] = {}
    for program, flags in _commands(_BENCHMARK, page.read_text(encoding="utf-8")):
        if program not in known:
            known[program] = _benchmark_flags(program) if (ROOT / program).is_file() else set()
        if not known[program]:
            unknown.append(f"{program}: no such benchmark")
        unknown += [f"{program} {flag}" for flag in flags if flag not in known[program]]
    assert not unknown, "\n".join(unknown)


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_code_a_page_names_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    missing = []
    for span in _SPAN.findall(text):
        for path, name in _PATH_NAME.findall(span):
            module = _resolve(path)
            if module is None:
                missing.append(f"{path} (no such module)")
            elif name not in _defined(module):
                missing.append(f"{path}: {name} (not defined there)")
        for candidate in span.replace(",", " ").split():
            path_match = _PATH.match(candidate.strip("()"))
            if path_match and "/" in path_match.group(1) and _resolve(path_match.group(1)) is None:
                missing.append(f"{candidate} (no such module)")
        qualified = _QUALIFIED.match(span)
        if qualified and qualified.group(1) in _classes():
            cls, attr = qualified.groups()
            if not any(f"{cls}.{attr}" in _defined(module) for module in _classes()[cls]):
                missing.append(f"{span} (no such attribute)")
    assert not missing, f"{page.relative_to(ROOT)} names code that is not there:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize("command", ["run", "sim"])
def test_every_flag_is_in_its_reference(command: str) -> None:
    """``actorproxy run``'s flags are each in docs/endpoints.md's flag table (the compatibility group's in
    docs/migrating.md), ``sim``'s in docs/engines/sim.md.

    A flag with several names (``--store``, ``--store-kind``; ``--x``, ``--no-x``) counts once any is there.
    """
    parser = next(a.choices for a in build_parser()._actions if isinstance(a.choices, dict))[command]
    missing = []
    for group in parser._action_groups:
        if command == "sim":
            page, section = ROOT / "docs" / "engines" / "sim.md", ""
        elif group.title and group.title.startswith("compatibility"):
            page, section = ROOT / "docs" / "migrating.md", ""
        else:
            page, section = ROOT / "docs" / "endpoints.md", "## `actorproxy run` flags"
        text = page.read_text(encoding="utf-8")
        if section:
            text = text[text.index(section):]
            text = text[: text.find("\n## ", len(section))]
        missing += [f"{page.relative_to(ROOT)}: " + " / ".join(action.option_strings)
                    for action in group._group_actions
                    if action.option_strings and "--help" not in action.option_strings
                    and not any(re.search(re.escape(name) + r"(?![\w-])", text) for name in action.option_strings)]
    assert not missing, "not described:\n" + "\n".join(missing)


_PYTHON = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package
        return False


@pytest.mark.parametrize("page", [p for p in PAGES if _PYTHON.search(p.read_text(encoding="utf-8"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_samples_parse_and_import_what_exists(page: Path) -> None:
    """Each ``python`` block is Python, and what it imports from actorproxy is there."""
    wrong = []
    for code in _PYTHON.findall(page.read_text(encoding="utf-8")):
        try:
            tree = ast.parse(code)
        except SyntaxError as exc:
            wrong.append(f"not Python: {exc}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("actorproxy"):
                module = importlib.import_module(str(node.module))
                wrong += [f"from {node.module} import {alias.name}" for alias in node.names
                          if not hasattr(module, alias.name) and not _submodule(f"{node.module}.{alias.name}")]
            elif isinstance(node, ast.Import):
                wrong += [f"import {alias.name}" for alias in node.names
                          if alias.name.startswith("actorproxy") and not _submodule(alias.name)]
    assert not wrong, f"{page.relative_to(ROOT)}:\n" + "\n".join(wrong)


def test_index_lists_every_page() -> None:
    """docs/index.md links every page under docs/ (a page no one can find is not documentation)."""
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in _LINK.findall(index.read_text())}
    pages = {page.resolve() for page in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    unlisted = sorted(str(page.relative_to(ROOT)) for page in pages - linked)
    assert not unlisted, "not in docs/index.md: " + ", ".join(unlisted)


def test_readme_layout_is_the_tree() -> None:
    """README.md's layout table names every package under actorproxy/, and only packages that exist."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Layout"):]
    named = set(re.findall(r"`actorproxy/(\w+)/`", table))
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert named == packages, (f"not in the table: {sorted(packages - named)}; "
                               f"not in the tree: {sorted(named - packages)}")
