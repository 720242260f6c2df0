"""Incremental detokenization: token ids in, text out, exact across split characters.

Byte-level BPE tokens (GPT-2 style, as in Qwen) can end in the middle of a
multi-byte UTF-8 character, so decoding each token on its own would emit
U+FFFD for half an emoji. `IncrementalDetokenizer` holds such bytes back until
the character is complete. The guarantee a caller can rely on::

    "".join(d.feed(chunk) for chunk in chunks) + d.flush() == tokenizer.decode(ids)

for any split of ``ids`` into ``chunks``, at O(1) amortised cost per token.
That holds for any ids with byte-level tokenizers (Qwen, GPT-2 family); with
other decoders (the windowed fallback) it holds for ids that spell valid
UTF-8, while invalid byte pieces may come out as a different number of U+FFFD.
"""

from __future__ import annotations

import codecs
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import ChatTokenizer

__all__ = ["IncrementalDetokenizer"]

#: Per-token bytes of byte-level tokenizers, built once per tokenizer (a cache).
_BYTE_TABLES: weakref.WeakKeyDictionary[ChatTokenizer, tuple[bytes, ...] | None] = (
    weakref.WeakKeyDictionary()
)
#: Per byte-level tokenizer: the text of each token id seen that decodes alone to whole characters (a cache that
#: fills as ids are streamed, up to the vocabulary; see ``_ByteLevel.feed``).
_WHOLE_TEXTS: weakref.WeakKeyDictionary[ChatTokenizer, dict[int, str]] = weakref.WeakKeyDictionary()

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, one chunk of ids at a time.

    One instance per generated sequence; not thread-safe. Text is exactly what
    ``tokenizer.decode`` (special tokens included) gives for all ids fed so far,
    except that an incomplete character at the end is held back until the ids
    that complete it arrive, or until `flush`.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        table = byte_table(tokenizer)
        self._impl: _ByteLevel | _Windowed = (
            _ByteLevel(table, _WHOLE_TEXTS.setdefault(tokenizer, {})) if table is not None else _Windowed(tokenizer)
        )
        #: Text completed by ``token_ids`` (may be empty while a character is split): the implementation's own
        #: method (no call of this class's per streamed token).
        self.feed: Callable[[Sequence[int]], str] = self._impl.feed

    def flush(self) -> str:
        """Text still held back, with U+FFFD for bytes that never formed a character.

        Ends the current sequence: later `feed` calls start a fresh one.
        """
        return self._impl.flush()


class _ByteLevel:
    """Exact path: concatenate token bytes and run a streaming UTF-8 decoder.

    This is what the Hugging Face ByteLevel decoder does for the whole
    sequence at once (bytes joined, then decoded with replacement); Python's
    incremental decoder substitutes U+FFFD for the same maximal invalid
    subparts, so the streamed text equals the one-shot text.
    """

    def __init__(self, table: tuple[bytes, ...], whole: dict[int, str]) -> None:
        self._table = table
        self._size = len(table)
        self._held = b""  # the bytes of a character not complete yet
        #: The text of each id seen that decodes alone to whole characters (shared by the tokenizer's detokenizers).
        self._whole = whole

    def feed(self, token_ids: Sequence[int]) -> str:
        table, size = self._table, self._size
        # Ids outside the vocabulary decode to nothing, as in `tokenizer.decode`.
        if len(token_ids) == 1:  # a streamed token alone: no generator
            i = token_ids[0]
            held = self._held
            if not held:  # (nearly every token: its text decoded before, looked up instead of decoded again)
                text = self._whole.get(i)
                if text is not None:
                    return text
            known = 0 <= i < size
            data = table[i] if known else b""
            if held:
                data = held + data
            text, used = codecs.utf_8_decode(data, "replace", False)
            if used == len(data):
                if known and not held:
                    self._whole[i] = text  # (at most one entry an id of the vocabulary)
                self._held = b""
            else:
                self._held = data[used:]
            return text
        data = b"".join(table[i] for i in token_ids if 0 <= i < size)
        if self._held:
            data = self._held + data
        # What codecs' incremental UTF-8 decoder does, without its Python-level method a token.
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._held = data[used:]
        return text

    def flush(self) -> str:
        data, self._held = self._held, b""
        return codecs.utf_8_decode(data, "replace", True)[0]


class _Windowed:
    """Fallback for other decoders: re-decode a short window of recent ids.

    The vLLM scheme. ``_ids[_prefix:_read]`` is already emitted and is
    decoded again only as context (SentencePiece-style decoders treat a
    leading space differently at the start of a text); the text after it is
    new. While the window's text ends in U+FFFD the last character may be
    incomplete, so nothing is emitted. After `_MAX_PENDING` such ids the
    bytes are mostly invalid: we emit up to the last id after which the text
    ends cleanly, or else all but the last `_TAIL` ids. An incomplete
    character at the end began within those (byte-fallback pieces carry one
    byte each, and a UTF-8 character has at most 4), so it is never cut.
    This keeps the window, and so the cost per id, bounded. (HF's
    ByteFallback decoder replaces a whole run of byte pieces when any byte in
    it is invalid, which no bounded window can foresee.)
    """

    _MAX_PENDING = 8
    _TAIL = 3
    #: Drop consumed ids once this many pile up, keeping memory bounded.
    _COMPACT_AT = 1024

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""

    def feed(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._decode(self._prefix, len(self._ids))
        if not text.endswith(REPLACEMENT):
            return self._advance(len(self._ids), text)
        if len(self._ids) - self._read <= self._MAX_PENDING:
            return ""
        for upto in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._prefix, upto)
            if not head.endswith(REPLACEMENT):
                return self._advance(upto, head)
        upto = len(self._ids) - self._TAIL
        return self._advance(upto, self._decode(self._prefix, upto))

    def flush(self) -> str:
        text = self._decode(self._prefix, len(self._ids))
        out = text[len(self._prefix_text) :]
        self._ids.clear()
        self._prefix = self._read = 0
        self._prefix_text = ""
        return out

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop])

    def _advance(self, upto: int, text: str) -> str:
        """Emit ``text`` (the decode of ``_ids[_prefix:upto]``) past what was emitted."""
        out = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, upto
        self._prefix_text = self._decode(self._prefix, self._read)
        if self._prefix >= self._COMPACT_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return out


def byte_table(tokenizer: ChatTokenizer) -> tuple[bytes, ...] | None:
    """The bytes each token id decodes to, or None if the decoder is not plain ByteLevel.

    Built once per tokenizer (about a second for a 150k vocabulary) and cached
    for the tokenizer's lifetime.
    """
    try:
        return _BYTE_TABLES[tokenizer]
    except KeyError:
        pass
    table = _build_byte_table(tokenizer)
    _BYTE_TABLES[tokenizer] = table
    return table


def _build_byte_table(tokenizer: ChatTokenizer) -> tuple[bytes, ...] | None:
    from tokenizers import decoders

    hf = tokenizer.hf
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    if getattr(hf, "clean_up_tokenization_spaces", False):
        # transformers then rewrites " ." to "." etc. after decoding: not per-token.
        return None
    size = len(hf)
    tokens = hf.convert_ids_to_tokens(list(range(size)))
    table: list[bytes] = []
    for token in tokens:
        if token is None:
            table.append(b"")
        else:
            # A character outside the byte alphabet (some added tokens): the
            # ByteLevel decoder then passes the token's own UTF-8 bytes through.
            raw = byte_level_bytes(token)
            table.append(token.encode("utf-8") if raw is None else raw)
    return tuple(table)


def byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a token's piece stands for in GPT-2's byte alphabet, or None if a character is outside it."""
    to_latin1, mapped_chars = _byte_level_maps()
    return None if piece.translate(mapped_chars) else piece.translate(to_latin1).encode("latin-1")


@functools.cache
def _byte_level_maps() -> tuple[dict[int, str], dict[int, None]]:
    """GPT-2's byte alphabet as `str.translate` tables.

    The first maps each alphabet character to the latin-1 character of its
    byte; the second deletes alphabet characters, so a token is fully in the
    alphabet iff translating with it leaves nothing.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    char_of = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = 256 + shifted
            shifted += 1
    to_latin1 = {char: chr(b) for b, char in char_of.items()}
    return to_latin1, dict.fromkeys(char_of.values())
