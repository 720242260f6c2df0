"""Compare the ids TITO recorded with a fresh rendering of the conversation (sans-IO).

The proxy records token ids incrementally: sampled ids are kept as sampled and
only new messages are rendered as fragments. ``--verify-tito`` re-renders the
conversation at finalize and reports where the two id sequences differ, and why.

Both sequences are split into turns at the turn-start token (the first token
of the template's assistant header, ``<|im_start|>`` for ChatML), and compared
turn by turn in linear time. A differing turn is decoded on both sides and
classified; the *expected* kinds are what TITO does on purpose:

* ``noncanonical_tokenization`` — an assistant turn with the same text: the
  policy sampled a token split that differs from the tokenizer's canonical one;
* ``reasoning_stripped`` — equal once ``<think>…</think>`` blocks are removed:
  the template drops earlier reasoning, TITO keeps what was sampled;
* ``echo_reserialised`` — equal once the agent's echo is normalised (tool-call
  JSON re-dumped with sorted keys, whitespace collapsed and trimmed).

The unexpected kinds are ``assistant_text_differs``, ``context_retokenized``
(a context turn with the same text but other ids), ``context_differs`` and
``structure_differs`` (the turn counts differ).
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..tokenization.tokenizer import ChatTokenizer
from .spans import SpanError, TurnFormat, turn_format

ASSISTANT_ROLE = "assistant"

_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_WHITESPACE = re.compile(r"\s+")
_ROLE = re.compile(r"\s*([A-Za-z_][\w-]*)")

_EXPECTED_KINDS = frozenset({"noncanonical_tokenization", "reasoning_stripped", "echo_reserialised"})


@attrs.frozen
class Difference:
    """One turn where the recorded ids and the fresh ones differ."""

    #: 0-based turn index (turns are split at the turn-start token).
    turn: int
    #: The role read from the turn's text, or ``""`` if unknown.
    role: str
    kind: str
    expected: bool
    #: ``[start, end)`` token range in the recorded ids.
    recorded: tuple[int, int]
    #: ``[start, end)`` token range in the fresh ids.
    fresh: tuple[int, int]


@attrs.frozen
class VerifyReport:
    """The outcome of comparing recorded ids with a fresh rendering."""

    recorded_tokens: int
    fresh_tokens: int
    #: Turns compared (the larger of the two sides' turn counts).
    turns: int
    differences: tuple[Difference, ...]
    #: How many differences its JSON lists (``wire.records``); all are counted.
    max_listed: int = attrs.field(default=20, eq=False)

    @property
    def expected(self) -> int:
        return sum(1 for d in self.differences if d.expected)

    @property
    def unexpected(self) -> int:
        return sum(1 for d in self.differences if not d.expected)

    @property
    def clean(self) -> bool:
        return not self.differences

    @property
    def by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for d in self.differences:
            counts[d.kind] = counts.get(d.kind, 0) + 1
        return counts


@attrs.frozen
class VerifyFailure:
    """The conversation could not be rendered afresh (the template refused it): why."""

    error: str


def verify_prompt(
    tokenizer: ChatTokenizer,
    recorded_prompt: Sequence[int],
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
) -> VerifyReport:
    """Compare ``recorded_prompt`` with ``messages`` rendered afresh (with the generation prompt)."""
    text = tokenizer.render(messages, tools=tools, add_generation_prompt=True, enable_thinking=enable_thinking)
    return compare(tokenizer, recorded_prompt, tokenizer.encode(text))


def compare(tokenizer: ChatTokenizer, recorded: Sequence[int], fresh: Sequence[int]) -> VerifyReport:
    """Compare two id sequences turn by turn and classify every differing turn."""
    ctx = _Context.of(tokenizer)
    rec = _as_array(recorded)
    new = _as_array(fresh)
    rec_bounds = _turn_bounds(rec, ctx.turn_start_id)
    new_bounds = _turn_bounds(new, ctx.turn_start_id)
    rec_turns, new_turns = len(rec_bounds) - 1, len(new_bounds) - 1
    differences: list[Difference] = []
    for turn in range(min(rec_turns, new_turns)):
        r = (rec_bounds[turn], rec_bounds[turn + 1])
        f = (new_bounds[turn], new_bounds[turn + 1])
        if rec[r[0] : r[1]] == new[f[0] : f[1]]:
            continue
        differences.append(ctx.classify(turn, rec[r[0] : r[1]], new[f[0] : f[1]], r, f))
    if rec_turns != new_turns:
        turn = min(rec_turns, new_turns)
        r = (rec_bounds[turn], len(rec))
        f = (new_bounds[turn], len(new))
        longer, at = (rec, r[0]) if rec_turns > new_turns else (new, f[0])
        bounds = rec_bounds if rec_turns > new_turns else new_bounds
        role = ctx.role_of(ctx.decode(longer[at : bounds[turn + 1]]))
        differences.append(
            Difference(turn=turn, role=role, kind="structure_differs", expected=False, recorded=r, fresh=f)
        )
    return VerifyReport(
        recorded_tokens=len(rec),
        fresh_tokens=len(new),
        turns=max(rec_turns, new_turns),
        differences=tuple(differences),
    )


def _as_array(ids: Sequence[int]) -> array[int]:
    if isinstance(ids, array) and ids.typecode == "i":
        return ids
    return array("i", ids)


def _turn_bounds(ids: array[int], turn_start_id: int | None) -> list[int]:
    """Turn boundaries: ``bounds[k]:bounds[k+1]`` is turn ``k`` (``len(bounds) - 1`` turns).

    A turn starts at every turn-start token; ids before the first one form a
    turn of their own. An empty sequence has no turns.
    """
    if not ids:
        return [0]
    bounds = [0]
    if turn_start_id is not None:
        bounds.extend(i for i, t in enumerate(ids) if t == turn_start_id and i)
    bounds.append(len(ids))
    return bounds


@attrs.frozen
class _Context:
    """What classification needs to know about the tokenizer and its template."""

    tokenizer: ChatTokenizer
    fmt: TurnFormat | None
    turn_start_id: int | None
    turn_start_text: str

    @classmethod
    def of(cls, tokenizer: ChatTokenizer) -> _Context:
        try:
            fmt: TurnFormat | None = turn_format(tokenizer)
        except SpanError:
            fmt = None
        start_id: int | None = None
        if fmt is not None:
            head = tokenizer.encode(fmt.header)
            if head and head[0] in tokenizer.special_ids:
                start_id = head[0]
        start_text = tokenizer.token_text(start_id) if start_id is not None else ""
        return cls(tokenizer=tokenizer, fmt=fmt, turn_start_id=start_id, turn_start_text=start_text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def role_of(self, text: str) -> str:
        """The role name at the start of a turn's text (after the turn-start token)."""
        if not self.turn_start_text or not text.startswith(self.turn_start_text):
            return ""
        match = _ROLE.match(text, len(self.turn_start_text))
        return match.group(1) if match else ""

    def classify(
        self, turn: int, rec: array[int], new: array[int], r: tuple[int, int], f: tuple[int, int]
    ) -> Difference:
        rec_text, new_text = self.decode(rec), self.decode(new)
        rec_role, new_role = self.role_of(rec_text), self.role_of(new_text)
        role = rec_role or new_role
        if ASSISTANT_ROLE in (rec_role, new_role):
            role = ASSISTANT_ROLE
            if rec_text == new_text:
                kind = "noncanonical_tokenization"
            else:
                rec_bare, new_bare = _strip_reasoning(rec_text), _strip_reasoning(new_text)
                if rec_bare == new_bare:
                    kind = "reasoning_stripped"
                elif self.normalise_echo(rec_bare) == self.normalise_echo(new_bare):
                    kind = "echo_reserialised"
                else:
                    kind = "assistant_text_differs"
        else:
            kind = "context_retokenized" if rec_text == new_text else "context_differs"
        return Difference(turn=turn, role=role, kind=kind, expected=kind in _EXPECTED_KINDS, recorded=r, fresh=f)

    def normalise_echo(self, text: str) -> tuple[str, str, str]:
        """``(head, body, tail)`` of an assistant turn, the body normalised as the echo matching does."""
        head, body, tail = "", text, ""
        if self.fmt is not None:
            if body.startswith(self.fmt.header):
                head, body = self.fmt.header, body[len(self.fmt.header) :]
            eot = body.rfind(self.fmt.eot_text)
            if eot >= 0:
                body, tail = body[:eot], body[eot:]
        body = _TOOL_CALL.sub(_redump_tool_call, body)
        return head, _WHITESPACE.sub(" ", body).strip(), tail


def _strip_reasoning(text: str) -> str:
    """``text`` without ``<think>…</think>`` blocks and the whitespace after them."""
    return _THINK_BLOCK.sub("", text) if "<think>" in text else text


def _redump_tool_call(match: re.Match[str]) -> str:
    inner = match.group(1)
    try:
        value = json.loads(inner)
    except ValueError:
        return f"<tool_call>{inner.strip()}</tool_call>"
    return f"<tool_call>{json.dumps(value, sort_keys=True, ensure_ascii=False)}</tool_call>"
