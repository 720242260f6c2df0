"""SGLang's cumulative stream, read in O(new tokens) objects per event: the repeated prefix is cut as bytes.

By default every ``/generate`` event repeats all the output so far: ``output_ids``,
``meta_info.output_token_logprobs`` (and, in older builds, the whole ``text``). Decoding
each event whole builds a Python int and a logprob entry for every earlier token again:
O(n) objects per event, O(n²) per generation (~0.5 ms per event at 2,000 tokens). SGLang
writes its events with orjson, so an event's arrays begin with the exact bytes of the
previous event's arrays: :class:`PrefixCutter` checks that they do (a byte comparison,
at memory speed) and cuts them out before the JSON is decoded, along with a cumulative
``text``, which the reader never uses. Only the new tokens are then decoded.

Nothing is assumed that is not checked: an event whose arrays do not begin with the
previous bytes (an incremental stream, an abort event carrying only the last token,
another serializer) is decoded whole, and the parser checks the counts either way.
Patterns are matched with their quotes, which cannot occur unescaped inside a JSON string.
"""

from __future__ import annotations

_IDS = b',"output_ids":['
_LOGPROBS = b'"output_token_logprobs":['
_TEXT = b'{"text":"'
_OPEN = b'"finish_reason":null'
_VERSION = b'"weight_version":'
_SPANS = b'"weight_versions"'
_ERROR = b'"error"'


class PrefixCutter:
    """Cuts the arrays' previous content out of each raw event (see module docstring)."""

    __slots__ = ("_ids", "_logprobs", "tokens")

    def __init__(self) -> None:
        self._ids = b""  # the previous event's output_ids, as bytes between the brackets
        self._logprobs = b""  # and its output_token_logprobs
        #: Tokens the remembered arrays hold (set by the reader once it decoded the event).
        self.tokens = 0

    def cut(self, raw: bytes, use: bool = True) -> tuple[bytes, int]:
        """``raw`` without the tokens the previous event already had, and how many were cut (0: whole).

        ``use=False`` (a stream not known to be cumulative yet) only remembers the arrays.
        """
        i = raw.find(_IDS)
        if i < 0:
            self._ids = self._logprobs = b""
            return raw, 0
        i += len(_IDS)
        old_ids, old_lps, tokens = self._ids, self._logprobs, self.tokens
        # The ends are searched for after the old content, when it is there: O(new bytes).
        ids_old = _extends(raw, i, old_ids)
        ids_end = raw.find(b"]", i + len(old_ids) if ids_old else i)
        j = raw.find(_LOGPROBS, ids_end)
        if ids_end < 0 or j < 0:
            self._ids = self._logprobs = b""
            return raw, 0
        j += len(_LOGPROBS)
        lps_old = _extends(raw, j, old_lps)
        if raw.startswith(b"]", j):
            lps_end = j
        else:
            lps_end = raw.find(b"]]", j + len(old_lps) - 1 if lps_old else j) + 1
        if lps_end <= 0:
            self._ids = self._logprobs = b""
            return raw, 0
        self._ids, self._logprobs = raw[i:ids_end], raw[j:lps_end]
        if not (use and tokens and ids_old and lps_old):
            return raw, 0
        ids_cut = i + len(old_ids) + (raw[i + len(old_ids)] == 44)  # and its comma
        lps_cut = j + len(old_lps) + (raw[j + len(old_lps)] == 44)
        text_end = i - len(_IDS) - 1  # the closing quote of a first key "text"
        if raw.startswith(_TEXT) and raw[text_end] == 34 and text_end > len(_TEXT):
            head = raw[: len(_TEXT)] + raw[text_end:i]
        else:
            head = raw[:i]
        return b"".join((head, raw[ids_cut:j], raw[lps_cut:])), tokens


def _extends(raw: bytes, at: int, prefix: bytes) -> bool:
    """``raw`` holds ``prefix`` at ``at``, followed by the next element or the array's end."""
    return bool(prefix) and raw.startswith(prefix, at) and raw[at + len(prefix) : at + len(prefix) + 1] in (b",", b"]")


def look(raw: bytes) -> tuple[bool, bytes | None]:
    """Whether event ``raw`` may be skipped when its next event has its version, and that version.

    A cumulative event need not be decoded when the next event of the same stream repeats
    it (the reader checks that the next one extends what it decoded before, as for any
    event) and stamps its tokens with the same version. Only an ordinary event qualifies,
    checked on its bytes: its arrays where SGLang writes them, no finish, no error, no
    weight-version spans. The version is the raw ``weight_version`` value (``b""`` when
    there is none), ``None`` when the event has spans (its tokens may carry other
    versions: nothing before it is skipped). A key cannot be forged from inside a JSON
    string (its quotes would be escaped).
    """
    if _SPANS in raw:
        return False, None
    ordinary = _IDS in raw and _OPEN in raw and _ERROR not in raw
    i = raw.find(_VERSION)
    if i < 0:
        return ordinary, b""
    i += len(_VERSION)
    end = raw.find(b",", i)
    close = raw.find(b"}", i)
    if end < 0 or 0 <= close < end:
        end = close
    return ordinary, raw[i:end] if end >= 0 else None
