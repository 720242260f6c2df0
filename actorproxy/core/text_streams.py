"""Streamed text, held back just enough: whitespace stripped at both ends, and OpenAI ``stop`` sequences."""

from __future__ import annotations


class StrippedText:
    """Accumulates text, emitting it stripped at both ends (trailing space held back)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._pending = ""
        self._started = False

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        combined = self._pending + text
        emitted = combined.rstrip()
        self._pending = combined[len(emitted) :]
        if emitted:
            self.parts.append(emitted)
        return emitted

    def release(self) -> str:
        """The trailing whitespace held back, emitted now: the text ends here as it was sampled."""
        emitted, self._pending = self._pending, ""
        if emitted:
            self.parts.append(emitted)
        return emitted

    @property
    def text(self) -> str:
        return "".join(self.parts)


class StopMatcher:
    """Applies OpenAI ``stop`` sequences to streamed content.

    Content passes through with the last ``len(longest stop) - 1`` characters
    held back, so a stop sequence split across chunks is still caught and never
    half-sent. After a match, :attr:`hit` is set and nothing more passes.

    ``include``: the text ends with the stop sequence (vLLM's ``include_stop_str_in_output``), not before it.
    While :attr:`armed` is false (the reply's first ``min_tokens``), text passes unmatched; a sequence found
    once armed must end in text pushed since (it may begin in the held-back end of the text before), as vLLM
    searches.
    """

    def __init__(self, stops: tuple[str, ...], *, include: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._include = include
        self._buffer = ""
        self._quiet = 0  # characters at the buffer's start pushed while unarmed
        self.armed = True
        self.hit = False
        #: The stop sequence that matched (Anthropic reports it as ``stop_sequence``).
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.hit or not text:
            return ""
        buffer = self._buffer + text
        if not self.armed:
            cut = max(0, len(buffer) - self._hold)
            emitted, self._buffer = buffer[:cut], buffer[cut:]
            self._quiet = len(self._buffer)
            return emitted
        quiet, self._quiet = self._quiet, 0
        found = [(at, stop) for stop in self._stops if (at := buffer.find(stop, max(0, quiet - len(stop) + 1))) >= 0]
        if found:
            at, self.matched = min(found)
            emitted = buffer[: at + len(self.matched)] if self._include else buffer[:at]
            self.hit = True
            self._buffer = ""
        else:
            cut = max(0, len(buffer) - self._hold)
            emitted, self._buffer = buffer[:cut], buffer[cut:]
        return emitted

    def flush(self) -> str:
        emitted, self._buffer = self._buffer, ""
        return emitted
