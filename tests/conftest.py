"""Shared fixtures."""

from __future__ import annotations

import pytest

from actorproxy.tokenization.tokenizer import ChatTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    """The built-in qwen3 tokenizer (built into the user cache on first use, then reused)."""
    return load_tokenizer(None)
