"""What a Trio test raises reaches pytest as it was raised (a pytest plugin, loaded by ``tests/conftest.py``).

pytest-trio runs each test (and its async fixtures) inside a nursery, which wraps
what the test raises in a ``BaseExceptionGroup``, and two outcomes got lost on
the way out:

- Ctrl-C. Trio delivers SIGINT as a ``KeyboardInterrupt`` in the running task;
  pytest ends the session only on a bare ``KeyboardInterrupt``, so the group was
  reported as that one test failing and the run went on. A group holding a
  ``KeyboardInterrupt`` is raised again as the interrupt itself (the group is its
  cause): pytest stops, reports the run interrupted and exits with status 2.
- A skip or xfail. pytest-trio unwraps a group of one ``pytest.skip`` (or
  ``pytest.xfail``) by raising a new, empty one: the summary said
  ``SKIPPED [1] .../_pytest/python.py:187: Skipped``. The original is raised
  instead, so the reason and the line that skipped are kept.

Each skip in the summary also names its test (``file:line: test_name: reason``).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

_OUTCOMES = (pytest.skip.Exception, pytest.xfail.Exception)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _as_raised() -> Generator[None, None, None]:
    try:
        yield
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is None:
            raise
        raise KeyboardInterrupt from group
    except _OUTCOMES as outcome:
        # pytest-trio's bare re-raise happens while it handles the group: the group is its context.
        group = outcome.__context__
        if isinstance(group, BaseExceptionGroup):
            leaves = _leaves(group)
            if len(leaves) == 1 and isinstance(leaves[0], type(outcome)):
                raise leaves[0].with_traceback(leaves[0].__traceback__) from None
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _as_raised())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _as_raised())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    return (yield from _as_raised())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3 and not hasattr(report, "wasxfail"):
        path, line, reason = longrepr
        prefix = "Skipped: " if reason.startswith("Skipped: ") else ""
        report.longrepr = (path, line, f"{prefix}{item.name}: {reason[len(prefix):]}")
    return report
