"""A worker process bounds the C allocator's heaps before its first thread, as ``actorproxy run`` does."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from actorproxy.config import ProxyConfig
from actorproxy.runtime import freed_memory
from actorproxy.workers import child


class _Stop(Exception):
    pass


def test_a_worker_limits_heaps_before_loading_its_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer's threads make heaps of their own: bounded only if the limit comes first (issue 33:
    RSS crept up by drain-freed memory left in per-thread heaps)."""
    calls: list[str] = []
    monkeypatch.setattr(freed_memory, "limit_heaps", lambda: calls.append("limit_heaps") or True)

    def load(path: str | None) -> None:
        calls.append("load_tokenizer")
        raise _Stop

    monkeypatch.setattr(child, "load_tokenizer_checked", load)
    (tmp_path / "config.pickle").write_bytes(pickle.dumps(ProxyConfig.of(port=0)))
    with pytest.raises(_Stop):
        child.main([str(tmp_path), "0", "-1", "-1"])
    assert calls == ["limit_heaps", "load_tokenizer"]
