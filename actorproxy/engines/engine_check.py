"""Start-up check: does the engine tokenize as our tokenizer does?

The proxy sends token ids, so an engine serving another model than the tokenizer's answers
"successfully" with garbage (a Gemma model behind the built-in Qwen3 tokenizer did exactly that).
Before serving, the proxy asks each engine what it can tell:

* the vocabulary size, where the engine reports it (llama.cpp: ``GET /v1/models`` ``meta.n_vocab``);
  it must be at least ours and at most a padding's worth larger (engines pad embedding tables);
* the ids of probe strings through the engine's tokenize endpoint (llama.cpp ``POST /tokenize``
  with ``parse_special``, vLLM and SGLang ``POST /tokenize`` without added special tokens): a mixed
  text (letters, digits, whitespace runs, code, CJK, emoji), a short conversation rendered with our
  chat template, and the text of each of our stop tokens alone. Each must give our ids exactly.

On a disagreement :func:`check_engine_tokenizer` raises :class:`TokenizerMismatch` (a start-up error
naming ``--tokenizer-path``) with one line saying what differs; ``actorproxy run`` and
``actorproxy check`` print it, and ``run`` exits 2. An engine without a tokenize
endpoint (404/405) is only checked for what it reports; ``--skip-tokenizer-check`` skips it all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..errors import StartupError
from ..http.client import HTTP11Client
from ..tokenization.tokenizer import ChatTokenizer
from .base import BackendError
from .connection import exchange_json

log = logging.getLogger(__name__)

PROBE_TEXT = (
    "Hello, world! It's 2025-06-01 12:34:56; x = [1, 22, 333, 4444]  \t  done.\n\n"
    "def f(a, b):\n    return a ** b  # ünïcödé, 日本語のテキスト, Привет, 🦙\r\n"
)
PROBE_CONVERSATION = (
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
)


class TokenizerMismatch(StartupError):
    """The engine's tokenizer is not ours (the message is one line)."""

    def __init__(self, message: str) -> None:
        super().__init__("--tokenizer-path", message)


@attrs.frozen
class EngineTokenizer:
    """What one engine says about its tokenizer (``None``/empty: it cannot say)."""

    vocab_size: int | None
    tokenized: Mapping[str, Sequence[int]]


def probe_texts(tok: ChatTokenizer) -> list[str]:
    texts = [PROBE_TEXT]
    try:
        texts.append(tok.render(PROBE_CONVERSATION, add_generation_prompt=True))
    except Exception as exc:  # a template that refuses this conversation: probe without it
        log.debug("tokenizer check: the chat template did not render the probe conversation: %s", exc)
    texts.extend(tok.decode([tid]) for tid in tok.stop_token_ids)
    return texts


def vocab_fits(ours: int, engine: int) -> bool:
    """The engine's table covers our ids, padded by at most 2% (or 1024 rows)."""
    return ours <= engine <= ours + max(1024, ours // 50)


def _ids(values: object) -> str:
    shown = list(values)[:12] if isinstance(values, Sequence) else values
    more = "..." if isinstance(values, Sequence) and len(values) > 12 else ""
    return f"{shown}{more}"


def compare(tok: ChatTokenizer, engine: EngineTokenizer) -> str | None:
    """A one-line description of the first disagreement, or ``None``."""
    if engine.vocab_size is not None and not vocab_fits(tok.vocab_size, engine.vocab_size):
        return f"the engine's vocabulary has {engine.vocab_size} tokens, tokenizer {tok.name!r} has {tok.vocab_size}"
    for text, theirs in engine.tokenized.items():
        ours = list(tok.encode(text))
        if ours != list(theirs):
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                      min(len(ours), len(theirs)))
            return (
                f"the engine tokenizes {text[:40]!r} as {_ids(list(theirs)[at:])} from token {at}, "
                f"tokenizer {tok.name!r} as {_ids(ours[at:])}"
            )
    return None


#: What an engine without a tokenize endpoint answers.
_NO_ROUTE = frozenset({404, 405, 501})
_ANY_ERROR = range(400, 600)


async def _post_tokenize(http: HTTP11Client, url: str, body: dict[str, Any]) -> list[int] | None:
    status, data = await exchange_json(http, "POST", url, f"{url}", body=body, accept=_NO_ROUTE)
    if status in _NO_ROUTE:
        return None
    tokens = data.get("tokens") if isinstance(data, Mapping) else None
    if isinstance(tokens, list) and tokens and isinstance(tokens[0], Mapping):
        tokens = [t.get("id") for t in tokens]  # llama.cpp with_pieces
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise BackendError(f"{url}: unexpected tokenize answer {str(data)[:200]}")
    return tokens


async def _llamacpp_vocab(http: HTTP11Client, base: str) -> int | None:
    status, answer = await exchange_json(http, "GET", f"{base}/v1/models", f"{base}/v1/models", accept=_ANY_ERROR)
    if status >= 400:
        return None
    data = answer.get("data") if isinstance(answer, Mapping) else None
    card = data[0] if isinstance(data, list) and data and isinstance(data[0], Mapping) else {}
    meta = card.get("meta")
    n_vocab = meta.get("n_vocab") if isinstance(meta, Mapping) else None
    return n_vocab if isinstance(n_vocab, int) else None


async def ask_engine(http: HTTP11Client, kind: str, base_url: str, texts: Sequence[str]) -> EngineTokenizer:
    """What the engine at ``base_url`` says (``kind``: llamacpp, vllm or sglang)."""
    base = base_url.rstrip("/")
    vocab = await _llamacpp_vocab(http, base) if kind == "llamacpp" else None
    tokenized: dict[str, list[int]] = {}
    for text in texts:
        if kind == "llamacpp":
            body: dict[str, Any] = {"content": text, "add_special": False, "parse_special": True}
        else:
            body = {"prompt": text, "add_special_tokens": False}
        ids = await _post_tokenize(http, f"{base}/tokenize", body)
        if ids is None:
            break  # no tokenize endpoint
        tokenized[text] = ids
    return EngineTokenizer(vocab, tokenized)


def engine_endpoints(engine: object) -> list[tuple[str, str, HTTP11Client]]:
    """``(kind, base URL, HTTP client)`` of each HTTP engine behind ``engine`` (a pool or one client).

    The check reuses the engine clients' own connections. In-process engines (the simulator) have
    none and are not checked.
    """
    members = engine.engines() if callable(getattr(engine, "engines", None)) else [engine]  # type: ignore[attr-defined]
    out = []
    for member in members:
        kind, base, http = getattr(member, "kind", ""), getattr(member, "base_url", None), getattr(member, "http", None)
        if isinstance(kind, str) and isinstance(base, str) and isinstance(http, HTTP11Client):
            out.append((kind, base, http))
    return out


async def check_engine_tokenizer(tok: ChatTokenizer, engine: object) -> None:
    """Raise :class:`TokenizerMismatch` if an engine behind ``engine`` disagrees with ``tok``."""
    await check_endpoints(tok, engine_endpoints(engine))


async def check_endpoints(tok: ChatTokenizer, endpoints: Sequence[tuple[str, str, HTTP11Client]]) -> None:
    """The check against each ``(kind, base URL, HTTP client)`` (see module doc)."""
    texts: list[str] | None = None
    for kind, url, http in endpoints:
        if kind not in ("llamacpp", "vllm", "sglang"):
            continue
        texts = texts if texts is not None else probe_texts(tok)
        try:
            answer = await ask_engine(http, kind, url, texts)
        except (ValueError, BackendError) as exc:
            log.warning("tokenizer check: could not ask %s (%s); not checked", url, exc)
            continue
        problem = compare(tok, answer)
        if problem is not None:
            raise TokenizerMismatch(
                f"tokenizer mismatch with the engine at {url}: {problem}; give the served model's tokenizer "
                "(its .gguf file or Hugging Face directory), or --skip-tokenizer-check"
            )
        checked = [f"{len(answer.tokenized)} probe strings"] if answer.tokenized else []
        if answer.vocab_size is not None:
            checked.append(f"vocabulary size {answer.vocab_size}")
        if checked:
            log.info("tokenizer check: %s agrees with %s (%s)", url, tok.name, ", ".join(checked))
        else:
            log.warning("tokenizer check: %s reports neither a vocabulary nor a tokenize endpoint; not checked", url)
