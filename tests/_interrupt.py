"""Ctrl-C ends the test run, also inside a Trio test (a pytest plugin, loaded by ``tests/conftest.py``).

Trio delivers SIGINT as a ``KeyboardInterrupt`` raised in the running task, and
pytest-trio runs each test (and its async fixtures) inside a nursery, which
wraps the interrupt in a ``BaseExceptionGroup``. pytest ends the session only on
a bare ``KeyboardInterrupt``; a group is reported as that one test failing, and
the run went on. Each phase of a test is wrapped here: a group that holds a
``KeyboardInterrupt`` is raised again as the interrupt itself (the group is its
cause), so pytest stops the run, reports it interrupted and exits with status 2.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest


def _unwrapped() -> Generator[None, None, None]:
    try:
        yield
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is None:
            raise
        raise KeyboardInterrupt from group


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _unwrapped())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _unwrapped())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    return (yield from _unwrapped())
