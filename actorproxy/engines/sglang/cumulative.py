"""SGLang's cumulative stream, read in O(new tokens) per event: the repeated prefix is skipped by its length.

By default every ``/generate`` event repeats all the output so far: ``output_ids``,
``meta_info.output_token_logprobs`` (and ``text``, which the reader never uses). Decoding
each event whole builds a Python int and a logprob entry for every earlier token again:
O(n) objects per event, O(n²) per generation (~0.5 ms per event at 2,000 tokens). SGLang
writes its events with orjson, so an event's arrays begin with the exact bytes of the
previous event's arrays. :class:`PrefixCutter` remembers how long those were and where
the arrays begin, and builds the event to decode from the new elements and the small
fields around them (the ``meta_info`` keys): the prefix is neither compared nor copied,
and ``text`` is left out. It reads the event where it lies (``start``/``stop`` in the
read's buffer): nothing of the event is copied but the new elements and those fields.
Without logprobs asked (no ``output_token_logprobs`` key), only ``output_ids`` is cut; with
the alternatives asked (``top_logprobs_num``), ``meta_info.output_top_logprobs`` is cut too
(its close found as :func:`_top_end` says; an event whose alternatives carry a text is
decoded whole).

What is checked instead, in O(1): each array holds, at the remembered length, the end of
an element followed by a comma or its close, and ``output_ids`` ends its old part with
the last id read before. An event that fails (an incremental stream, an abort event
carrying only the last token, another serializer) is decoded whole, and the reader checks
the counts either way (a logprob entry that does not name its token is an error).
Patterns are matched with their quotes, which cannot occur unescaped inside a JSON string.
Where ``output_token_logprobs`` ends is found outside any string: SGLang writes an entry's
text there when asked (``return_text_in_logprobs``; the proxy does not ask, and the entry is
``[logprob, id, null]``), and a text may hold ``]]``. The common entry's close is told by the
first quote after it (a key's), with no more calls than a search for ``]]``; a quote among
the entries (a text) has each string skipped whole, escapes counted (:func:`_close`).

Events read together are told apart by their keys (:func:`look`: one the next repeats is
not decoded at all); :meth:`PrefixCutter.look` searches a long event without the text and
arrays the previous event had, so that too costs O(new tokens), not O(event); and
:meth:`PrefixCutter.line_break` finds an event's line break (that it is one ``data:`` line,
read where the relay hub received it) without searching the arrays' old content either.
"""

from __future__ import annotations

_IDS = b',"output_ids":['
_LOGPROBS = b'"output_token_logprobs":['
_TOP = b'"output_top_logprobs":['
_OPEN = b'"finish_reason":null'
_VERSION = b'"weight_version":'
_SPANS = b'"weight_versions"'
_ERROR = b'"error"'
_TEXT = b'{"text":"'
#: Old content (bytes) below which :meth:`PrefixCutter.look` searches the event whole: its checks cost more.
_LONG = 1024
#: Old content (bytes) below which :meth:`PrefixCutter.line_break` searches the event whole: its own searches
#: (five, ~900 instructions each to call) cost more than a memchr over less (0.1 instruction a byte).
_SEARCHED = 96 * 1024
#: Where the arrays are searched for, before where they were in the previous event (its text may shrink).
_SLACK = 256
_COMMA, _OPEN_BRACKET, _CLOSE, _BACKSLASH, _NULL_END, _BRACE = 0x2C, 0x5B, 0x5D, 0x5C, 0x6C, 0x7D
_NONE = -1  # no output_token_logprobs (logprobs not asked)
Bytes = bytes | bytearray


class PrefixCutter:
    """Cuts the arrays' previous content out of each raw event (see module docstring)."""

    __slots__ = ("_at", "_ids", "_last", "_logprobs", "_top", "tokens")

    def __init__(self) -> None:
        self._at = 0  # where the previous event's output_ids began (from the event's start)
        self._ids = 0  # the length of its content (between the brackets), and of output_token_logprobs'
        self._logprobs = 0
        self._top = 0  # and of output_top_logprobs' (when the alternatives are asked)
        self._last: Bytes = b""  # its last id, as written
        #: Tokens the remembered arrays hold (set by the reader once it decoded the event).
        self.tokens = 0

    def cut(self, raw: Bytes, start: int = 0, stop: int | None = None, use: bool = True, top: bool = False
            ) -> tuple[bytes | None, int]:
        """The event ``raw[start:stop]`` without the tokens the previous event already had, and how many
        were cut; ``(None, 0)``: nothing was cut, decode the event whole.

        ``use=False`` (a stream not known to be cumulative yet) only remembers the arrays. ``top``: the
        alternatives were asked for (``top_logprobs_num``): ``output_top_logprobs`` is cut too (:func:`_top_end`).
        """
        if stop is None:
            stop = len(raw)
        was = self._at  # (a conditional, not max(): the builtin's call costs ~900 instructions)
        i = raw.find(_IDS, start + was - _SLACK if was > _SLACK else start, stop)
        if i < 0 and was > _SLACK:
            i = raw.find(_IDS, start, stop)
        if i < 0:
            return self._forget()
        a = i + len(_IDS)
        old_ids, old_lps, tokens = self._ids, self._logprobs, self.tokens
        cut = False
        if use and tokens > 0 and old_ids > 0:  # the old content ends at ``at`` with the last id read before
            at = a + old_ids
            last = self._last
            begin = at - len(last)
            cut = at < stop and raw[at] in (_COMMA, _CLOSE) and raw.startswith(last, begin) and raw[begin - 1] in (
                _COMMA, _OPEN_BRACKET)
        ids_end = raw.find(b"]", a + old_ids if cut else a, stop)
        if ids_end < 0:
            return self._forget()
        j = raw.find(_LOGPROBS, ids_end, stop)
        if j < 0:  # no logprobs: the ids alone
            b = lps_end = end = stop
            cut = cut and old_lps == _NONE
            lps = _NONE
        else:
            b = j + len(_LOGPROBS)
            end = b + old_lps
            cut = cut and old_lps > 0 and end < stop and raw[end - 1] == _CLOSE and raw[end] in (_COMMA, _CLOSE)
            if b < stop and raw[b] == _CLOSE:
                lps_end = b
            else:
                # Where the entries close ("]]", the array's bracket the second), searched from outside any
                # string (an old entry's close, or the array's open): an entry's text may hold "]]". Between
                # the close and the first quote after it lie only "," and "}" (a key follows): a "]" two bytes
                # before that quote is the close (the common entry: its text null, no quote among the
                # entries). No quote: the array ends the event ("]]}}"), or the first "]]" is its close.
                at = end - 1 if cut else b
                quote = raw.find(b'"', at, stop)
                if quote < 0:
                    lps_end = stop - 3 if raw[stop - 3] == _CLOSE else raw.find(b"]]", at, stop) + 1
                elif raw[quote - 2] == _CLOSE:
                    lps_end = quote - 2
                else:  # a quote among the entries: a text (return_text_in_logprobs), or another layout
                    lps_end = _close(raw, at, stop, quote)
                if lps_end <= at:
                    return self._forget()
            lps = lps_end - b
        if top:  # the alternatives' array, after the logprobs' (SGLang writes it there)
            k = raw.find(_TOP, lps_end, stop) if j >= 0 else -1
            if k < 0:
                return self._forget()
            c = k + len(_TOP)
            old_top = self._top
            top_at = c + old_top
            cut = cut and old_top > 0 and top_at < stop and raw[top_at - 1] in (_CLOSE, _NULL_END) and raw[top_at] in (
                _COMMA, _CLOSE)
            top_end = c if not cut and c < stop and raw[c] == _CLOSE else _top_end(raw, top_at - 1 if cut else c, stop)
            if top_end < 0:
                return self._forget()
            self._top = top_end - c
        self._at, self._ids, self._logprobs = i - start, ids_end - a, lps
        if ids_end > a:
            self._last = raw[(raw.rfind(b",", a, ids_end) + 1 or a) : ids_end]  # (a copy: no bytes() of it)
        if not cut:
            return None, 0
        # The new elements (after the old ones and their comma) and the fields between and after the arrays.
        new_ids = raw[a + old_ids + 1 : ids_end] if ids_end > a + old_ids else b""
        if j < 0:
            return b"".join((b'{"text":"","output_ids":[', new_ids, raw[ids_end:stop])), tokens
        new_lps = raw[end + 1 : lps_end] if lps_end > end else b""
        if not top:
            return b"".join((b'{"text":"","output_ids":[', new_ids, raw[ids_end:b], new_lps, raw[lps_end:stop])), tokens
        new_top = raw[top_at + 1 : top_end] if top_end > top_at else b""
        return b"".join((b'{"text":"","output_ids":[', new_ids, raw[ids_end:b], new_lps, raw[lps_end:c], new_top,
                         raw[top_end:stop])), tokens

    def look(self, raw: Bytes, start: int = 0, stop: int | None = None) -> tuple[bool, bytes | None]:
        """:func:`look` at event ``raw[start:stop]`` of this stream, without searching what it repeats.

        The previous event's text and arrays (their old content, where this event's lie),
        when long and free of any quote, are left out of the searches: every key searched
        for holds a quote, so none can lie there. The checks are single-byte finds
        (``memchr``, ~1 instruction for 32 bytes) where the keys' searches cost ~1 a byte.
        What is left is joined with spaces (no key holds one: none is made at a seam).
        Anything else (a short event, a text with quotes, arrays not where the previous
        event's were) is searched whole. Nothing is remembered.
        """
        if stop is None:
            stop = len(raw)
        old_ids, old_lps, old_top = self._ids, self._logprobs, self._top
        if old_ids + old_lps + old_top < _LONG:
            return look(raw, start, stop)
        text = start + len(_TEXT)
        i = raw.find(_IDS, max(text, start + self._at - _SLACK), stop)
        if i < 0 or raw[start:text] != _TEXT:
            return look(raw, start, stop)
        a = i + len(_IDS)
        # The text holds no quote (the first is its close): only its key is kept.
        parts = [raw[start:text], raw[i - 1 : a]] if raw.find(b'"', text, i) == i - 1 else [raw[start:a]]
        at = a + old_ids if 0 < old_ids and a + old_ids < stop and raw.find(b'"', a, a + old_ids) < 0 else a
        j = raw.find(_LOGPROBS, at, stop)
        b = j + len(_LOGPROBS)
        if j >= 0 and 0 < old_lps and b + old_lps < stop and raw.find(b'"', b, b + old_lps) < 0:
            parts.append(raw[at:b])
            at = b + old_lps
            k = raw.find(_TOP, at, stop) if old_top > 0 else -1  # (the alternatives', when they are cut)
            c = k + len(_TOP)
            if k >= 0 and c + old_top < stop and raw.find(b'"', c, c + old_top) < 0:
                parts += (raw[at:c], raw[c + old_top : stop])
            else:
                parts.append(raw[at:stop])
        else:
            parts.append(raw[at:stop])
        return look(b" ".join(parts))

    def line_break(self, raw: Bytes, start: int = 0, stop: int | None = None) -> int:
        """Where event ``raw[start:stop]``'s first line break lies (``-1``: none), not searched for in the
        arrays' old content when it lies where :meth:`cut` takes it to (its bounds checked as there).

        That content is taken to repeat the previous event's, which had no line break (it was
        read as one line: searched so in its turn, or whole); like the rest of what an event
        repeats, it is neither compared nor copied, and not searched either: the search
        (``memchr``, ~0.1 instruction a byte) covers the text and the new part, not the ~560 KB
        an event repeats at 16,000 tokens (nor the alternatives', when :meth:`cut` cuts them). Anything
        else is searched whole, and so is an event whose old content is under ``_SEARCHED``.
        """
        if stop is None:
            stop = len(raw)
        old_ids, old_lps, old_top = self._ids, self._logprobs, self._top
        was = self._at
        if self.tokens <= 0 or old_ids <= 0 or old_ids + old_lps + old_top < _SEARCHED:
            return raw.find(b"\n", start, stop)
        i = raw.find(_IDS, start + was - _SLACK if was > _SLACK else start, stop)
        at = i + len(_IDS) + old_ids
        if i < 0 or at >= stop or raw[at] not in (_COMMA, _CLOSE):
            return raw.find(b"\n", start, stop)
        first = raw.find(b"\n", start, i + len(_IDS))  # the text
        if first >= 0 or old_lps <= 0:
            return first if first >= 0 else raw.find(b"\n", at, stop)
        j = raw.find(_LOGPROBS, at, stop)
        end = j + len(_LOGPROBS) + old_lps
        if j < 0 or end >= stop or raw[end - 1] != _CLOSE:
            return raw.find(b"\n", at, stop)
        first = raw.find(b"\n", at, j)
        if first >= 0 or old_top <= 0:
            return first if first >= 0 else raw.find(b"\n", end, stop)
        k = raw.find(_TOP, end, stop)  # (the alternatives' old content, when they are cut: not searched either)
        top_at = k + len(_TOP) + old_top
        if k < 0 or top_at >= stop or raw[top_at - 1] not in (_CLOSE, _NULL_END):
            return raw.find(b"\n", end, stop)
        first = raw.find(b"\n", end, k)
        return first if first >= 0 else raw.find(b"\n", top_at, stop)

    def _forget(self) -> tuple[None, int]:
        self._ids = self._logprobs = self._top = 0
        self._last = b""
        return None, 0


def _top_end(raw: Bytes, at: int, stop: int) -> int:
    """Where the alternatives' array that goes on at ``at`` (outside any string: an old entry's last byte, or
    the first entry's first) closes; ``-1``: not found as SGLang writes it, decode the event whole.

    Its entries, ``[[logprob, id, null], ...]`` or ``null`` a token, hold no quote (the proxy
    does not ask for their text), and a key follows the array: the first quote from ``at`` is
    that key's, right after the array's ``],``. No quote: the array ends ``meta_info``, which
    ends the event (``]}}``). A quote among the entries is a text's (it follows an id and its
    comma, never a bracket): such an event is decoded whole.
    """
    quote = raw.find(b'"', at, stop)
    if quote < 0:
        end = stop - 3
        return end if end > at and raw[end] == _CLOSE and raw[end + 1] == raw[end + 2] == _BRACE else -1
    if quote - 2 <= at or raw[quote - 1] != _COMMA or raw[quote - 2] != _CLOSE:
        return -1
    return quote - 2


def _close(raw: Bytes, at: int, stop: int, quote: int) -> int:
    """Where the array of logprob entries that goes on at ``at`` (outside any string) closes: the second
    bracket of its first ``]]`` outside a JSON string (``-1``: not before ``stop``); ``quote``: the first
    quote from ``at`` (``-1``: none).

    An entry's text (SGLang's ``return_text_in_logprobs``) may hold ``]]``: each string
    is skipped whole, its close found past escaped quotes (a quote after an odd number of
    backslashes). Each search for ``]]`` stops at the next quote: O(the entries' bytes).
    """
    while True:
        close = raw.find(b"]]", at, stop if quote < 0 else quote)
        if close >= 0:
            return close + 1
        if quote < 0:
            return -1
        at = quote + 1
        while True:  # to the string's close
            quote = raw.find(b'"', at, stop)
            if quote < 0:
                return -1
            escape = quote
            while raw[escape - 1] == _BACKSLASH:
                escape -= 1
            at = quote + 1
            if not (quote - escape) & 1:
                break
        if at + 1 < stop and raw[at] == _CLOSE == raw[at + 1]:  # (the last entry's text: the array closes)
            return at + 1
        quote = raw.find(b'"', at, stop)


def look(raw: Bytes, start: int = 0, stop: int | None = None) -> tuple[bool, bytes | None]:
    """Whether event ``raw[start:stop]`` may be skipped when its next event has its version, and that version.

    A cumulative event need not be decoded when the next event of the same stream repeats
    it (the reader checks that the next one extends what it decoded before, as for any
    event) and stamps its tokens with the same version. Only an ordinary event qualifies,
    checked on its bytes: its arrays where SGLang writes them, no finish, no error, no
    weight-version spans. The version is the raw ``weight_version`` value (``b""`` when
    there is none), ``None`` when the event has spans (its tokens may carry other
    versions: nothing before it is skipped). A key cannot be forged from inside a JSON
    string (its quotes would be escaped).
    """
    # ``find``, not ``in``: ``bytes in bytes`` first tries the needle as an int (one byte's value), and the
    # TypeError it formats and drops cost more than the search (~1,900 instructions a test, four an event).
    # The event copied once: a find without bounds parses one argument, not three (~70 ns less, five an event).
    event = raw if start == 0 and (stop is None or stop == len(raw)) else raw[start:stop]
    if event.find(_SPANS) >= 0:
        return False, None
    ordinary = event.find(_IDS) >= 0 and event.find(_OPEN) >= 0 and event.find(_ERROR) < 0
    i = event.find(_VERSION)
    if i < 0:
        return ordinary, b""
    i += len(_VERSION)
    end = event.find(b",", i)
    close = event.find(b"}", i)
    if end < 0 or 0 <= close < end:
        end = close
    return ordinary, bytes(event[i:end]) if end >= 0 else None
