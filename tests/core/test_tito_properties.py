"""Property-based TITO tests: generated multi-turn sessions through the real runtime (no HTTP).

Each example drives ONE session with a generated sequence of actions against
the simulated engine, whose every output is scripted (with a marker word unique
to the turn), then finalizes it and checks the segments and steps read back:

1. every segment satisfies :func:`check_segment_invariants`;
2. boundaries fall exactly where the generator broke the append-only contract
   (``boundary_reason`` per step, ``start_reason``/``boundary_reason`` per segment);
3. no continuation re-tokenizes sampled text: its fragment never holds an earlier
   reply's text, and the segment holds each step's sampled ids as the engine
   emitted them;
4. every completed step is in exactly one segment.

Actions: ``continue`` (the agent echoes our reply in one of several shapes, then
adds tool results or a user message), ``history_rewrite`` (an edited user
message, tool result or reply; compaction; a ``<system-reminder>`` appended to a
user message), ``system_changed`` (the system text only) and
``tool_schema_change`` (a tool added, removed, or the list reordered). Requests
are never the previous request again nor a prefix of it, except for ``retry``.

The same generator (:class:`Conversation`) drives three more properties:

* **retries** (``retry``: the previous request again, copied, with the same turn id
  or the same list under no or another turn id): the previous step is superseded,
  the retry runs on the same prompt, takes its place, and is never a boundary;
* **sub-agents**: a main conversation and 1-3 sub-agents interleaved in one session
  id; each sub-agent gets one child ``<session>/sub-<n>`` with one unbroken segment,
  and the main session's boundaries are only its own;
* **recompute mode**: one segment per session, rebuilt in place at every contract
  break, the replies still present trained with the engine's prompt logprobs.

The last test checks that an in-place edit of a message
dict the agent already sent is a history rewrite (the segment keeps snapshots).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import attrs
import hypothesis.strategies as st
from _util import (
    READ_TOOL,
    SEARCH_TOOL,
    WEATHER_TOOL,
    RecordingBackend,
    TurnResult,
    check_segment_invariants,
    reserialise,
    run_request,
)
from hypothesis import HealthCheck, event, given, settings

from actorproxy.config import ProxyConfig
from actorproxy.core.requests import ChatRequest, Identity
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import ScriptedOutput, SimConfig, SimEngine
from actorproxy.tokenization.tokenizer import ChatTokenizer

TOOL_POOL = (WEATHER_TOOL, SEARCH_TOOL, READ_TOOL)
STOP = "STOPHERE"

ACTIONS = ("continue", "continue", "history_rewrite", "history_rewrite", "system_changed", "tool_schema_change")
ECHOES = ("as_is", "reserialise", "drop_reasoning", "inline_reasoning", "reasoning_key", "padded", "parts", "args_dict")
REWRITES = ("edit", "edit_last", "compaction", "reminder", "edit_tool_result", "edit_reply", "edit_reply")
FOLLOW_UPS = ("plain", "parts", "agent_note")
#: The contract breaks, in the order ``plan_turn`` checks them.
BREAKS = ("tool_schema_change", "system_changed", "history_rewrite")

PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def marker(turn: int) -> str:
    """A word only reply ``turn`` contains (no marker is a substring of another)."""
    return f"Qz{turn}kestrel"


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"])


def _call_arguments(name: str, mark: str, n: int) -> dict[str, Any]:
    if name == "get_weather":
        return {"city": f"{mark} town", "days": n + 1}
    if name == "search":
        return {"query": f"{mark} prices"}
    return {"path": f"src/{mark}.py"}


# -- what the engine samples ---------------------------------------------------


@attrs.frozen
class Reply:
    """What the engine is scripted to sample for one turn."""

    text: str
    ids: tuple[int, ...]
    #: Ends without ``<|im_end|>``: a ``length`` finish.
    truncated: bool = False
    #: A stop string the request carries; the reply holds it (and text after it).
    stop: str | None = None

    @property
    def ends_open(self) -> bool:
        """The segment's last sampled token is not ``<|im_end|>``."""
        return self.truncated or self.stop is not None


@st.composite
def replies(
    draw: st.DrawFn,
    tokenizer: ChatTokenizer,
    turn: int,
    tools: list[dict[str, Any]],
    thinking: bool,
    stop_ok: bool = True,
) -> Reply:
    """A reply with the turn's marker in every part: reasoning, text, tool-call arguments.

    Endings: the sampled ``<|im_end|>``; ``length`` (no ``<|im_end|>``: after the text, inside
    the reasoning, or inside a tool call); a stop string with more text sampled after it
    (only if ``stop_ok``: a retry re-sends the previous request's stop strings, maybe none).
    """
    mark = marker(turn)
    parts: list[str] = []
    names = [_tool_name(t) for t in tools]
    calls = draw(st.integers(0, 2)) if names else 0
    ending = draw(st.sampled_from(["eot", "eot", "eot", "length", "stop", "cut"]))
    if ending == "stop" and not stop_ok:
        ending = "eot"
    if thinking and (ending == "cut" and not calls or draw(st.booleans())):
        parts.append(f"<think>\nWeigh the {mark} options, café ☀ before answering.\n</think>\n\n")
    if calls:
        if draw(st.booleans()):
            parts.append(f"Looking up {mark} first.\n")
        bodies = []
        for n in range(calls):
            name = draw(st.sampled_from(names))
            body = json.dumps({"name": name, "arguments": _call_arguments(name, mark, n)}, ensure_ascii=False)
            bodies.append(f"<tool_call>\n{body}\n</tool_call>")
        parts.append("\n".join(bodies))
        ending = "cut" if ending == "cut" else "eot"
    else:
        ending = "length" if ending == "cut" and not parts else ending
        parts.append(f"The {mark} answer: {mark} fits the plan, 東京 ☀ well.")
        if ending == "stop":
            parts.append(f" {STOP} and then {mark} rambles on after the stop string.")
    text = "".join(parts)
    ids = list(tokenizer.encode(text))
    if ending == "cut":
        # Cut mid-reasoning, or mid-call (the call does not parse and comes back as text).
        ids = ids[: (ids.index(tokenizer.think_end_id) if not calls else len(ids) - 3)]
    elif ending != "length":
        ids.append(tokenizer.eot_token_id)
    truncated = ending in ("length", "cut")
    return Reply(tokenizer.decode(ids), tuple(ids), truncated=truncated, stop=STOP if ending == "stop" else None)


# -- what the agent sends ---------------------------------------------------------


def echo_of(message: dict[str, Any], how: str, null_content: bool) -> dict[str, Any]:
    """The agent's copy of our reply, written the way ``how`` says (all mean the same turn)."""
    message = copy.deepcopy(message)
    reasoning = message.get("reasoning_content")
    if how == "reserialise":
        message = reserialise(message)
    elif how == "drop_reasoning":
        message.pop("reasoning_content", None)
    elif how == "inline_reasoning" and reasoning:
        del message["reasoning_content"]
        message["content"] = f"<think>\n{reasoning}\n</think>\n\n{message.get('content') or ''}"
    elif how == "reasoning_key" and reasoning:
        message["reasoning"] = message.pop("reasoning_content")
    elif how == "padded" and message.get("content"):
        message["content"] = f"  {message['content']}\n\n"
    elif how == "parts" and message.get("content"):
        message["content"] = [{"type": "text", "text": message["content"]}]
    elif how == "args_dict":
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    if not message.get("content") and message.get("tool_calls"):
        message["content"] = None if null_content else ""
    return message


def follow_up(reply: dict[str, Any], turn: int, how: str, extra_user: bool) -> list[dict[str, Any]]:
    """What the agent adds after our reply: tool results for its calls, and/or a user message."""
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": call["id"], "content": f"Tool result {turn}.{i}: 21 degrees, done."}
        for i, call in enumerate(reply.get("tool_calls") or ())
    ]
    if out and not extra_user:
        return out
    text = f"Follow-up question number {turn}: what next?"
    if how == "agent_note":
        # An assistant turn the agent wrote itself (not sampled): context, like a user message.
        out.append({"role": "user", "content": f"Note for turn {turn}."})
        out.append({"role": "assistant", "content": f"Agent-written note {turn}: noted."})
    out.append({"role": "user", "content": [{"type": "text", "text": text}] if how == "parts" else text})
    return out


def _indices(messages: list[dict[str, Any]], role: str, below: int) -> list[int]:
    return [i for i, m in enumerate(messages[:below]) if m["role"] == role]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def rewrite(
    data: st.DataObject,
    sent: list[dict[str, Any]],
    base: list[dict[str, Any]],
    turn: int,
    keep_first: bool,
    sampled_here: set[int],
) -> list[dict[str, Any]]:
    """A request that does not extend what the segment accounts for, with something new to answer.

    ``sent`` is the previous request; ``base`` is ``sent`` plus our reply's echo and the follow-up.
    Only messages of ``sent`` and the echo are edited: the segment accounts for all of them.
    ``keep_first``: leave the first message after the system prompt alone (with a new system
    prompt, a new first message is a sub-agent's conversation). ``sampled_here``: where the
    replies sampled in the open segment are (others are context, compared without reasoning).
    """
    replies_at = _indices(base, "assistant", len(sent) + 1)
    users = [i for i in _indices(base, "user", len(sent)) if i > 1 or not keep_first]
    kinds = [
        k
        for k in REWRITES
        if (k != "edit_last" or (sent[-1]["role"] == "user" and (len(sent) > 2 or not keep_first)))
        and (k != "compaction" or not keep_first)
        and (k not in ("edit", "reminder") or users)
        and (k != "edit_tool_result" or _indices(base, "tool", len(sent)))
        and (k != "edit_reply" or replies_at)
    ]
    kind = data.draw(st.sampled_from(kinds), label="rewrite")
    event(f"rewrite: {kind}")
    out = list(base)
    if kind == "edit_last":
        # The agent edits its last message and asks again (our reply is dropped).
        return [*sent[:-1], {**sent[-1], "content": f"{_text(sent[-1]['content'])} (edited at turn {turn})"}]
    if kind == "compaction":
        # The first turns after the system prompt become one summary message.
        cuts = [i for i in _indices(base, "user", len(base)) if i >= 2]
        cut = data.draw(st.sampled_from([*cuts, len(base)]), label="compaction cut")
        summary = {"role": "user", "content": f"Summary of the work so far (compacted at turn {turn})."}
        tail = base[cut:] or [{"role": "user", "content": f"Go on from the summary, turn {turn}."}]
        return [base[0], summary, *tail]
    if kind == "edit_tool_result":
        index = data.draw(st.sampled_from(_indices(base, "tool", len(sent))), label="tool result")
        out[index] = {**out[index], "content": f"{out[index]['content']} (truncated at turn {turn})"}
        return out
    if kind == "edit_reply":
        # The agent changes a reply we sampled (its text, or a tool call's arguments).
        index = data.draw(st.sampled_from(replies_at), label="reply")
        edited = copy.deepcopy(out[index])
        targets = ["content", *(["arguments", "name"] if edited.get("tool_calls") else [])]
        if index in sampled_here:
            targets.append("reasoning")
        target = data.draw(st.sampled_from(targets), label="reply part")
        event(f"edit_reply: {target}")
        if target == "arguments":
            edited["tool_calls"][-1]["function"]["arguments"] = json.dumps({"edited": turn})
        elif target == "name":
            edited["tool_calls"][-1]["function"]["name"] = f"renamed_{turn}"
        elif target == "reasoning":
            # Reasoning may be dropped, but reasoning echoed must be the one sampled.
            edited.pop("reasoning", None)
            edited["content"] = _text(edited.get("content")).rpartition("</think>")[2] or edited.get("content")
            edited["reasoning_content"] = f"Reasoning rewritten by the agent at turn {turn}."
        else:
            edited["content"] = f"{_text(edited.get('content'))} Edited by the agent at turn {turn}."
        out[index] = edited
        return out
    index = data.draw(st.sampled_from(users), label="user message")
    old = _text(out[index]["content"])
    if kind == "edit":
        out[index] = {**out[index], "content": f"{old} Actually, make it turn {turn}."}
    else:
        reminder = f"<system-reminder>\nThe date changed (turn {turn}).\n</system-reminder>"
        out[index] = {**out[index], "content": f"{old}\n\n{reminder}"}
    return out


# -- running a session -----------------------------------------------------------


@attrs.define
class Turn:
    #: The turn's number in the whole session (sub-agents included): its reply's marker.
    number: int
    request: ChatRequest
    reply: Reply
    #: The step's expected ``boundary_reason``: the reason this turn opens a segment, else None.
    expected: str | None
    turn_id: str | None = None
    #: A retry: the index (in its conversation) of the turn it re-sends.
    retry_of: int | None = None
    #: The numbers of the earlier replies the request holds as our own echoes (not edited), in order.
    echoed: tuple[int, ...] = ()
    #: The session the runtime ran it in (``TurnDone.session_id``).
    session_id: str | None = None


@attrs.define
class Conversation:
    """One agent's conversation: draws its next request from the last one and our last reply.

    ``actions`` are drawn from for every turn after the first (``retry``: the previous
    request again, copied); ``turn_ids``: turns may carry an ``X-Turn-Id``.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    enable_thinking: bool | None
    actions: tuple[str, ...] = ACTIONS
    turn_ids: bool = False
    turns: list[Turn] = attrs.field(factory=list)
    #: Our last reply, as the runtime returned it.
    last: dict[str, Any] = attrs.field(factory=dict)
    #: ``id(echo)`` -> (the number of the reply it echoes, the echo, kept alive so the id stays unique).
    echoes: dict[int, tuple[int, dict[str, Any]]] = attrs.field(factory=dict)

    def next_turn(self, data: st.DataObject, tokenizer: ChatTokenizer, number: int) -> Turn:
        expected: str | None = "session_start"
        messages = self.messages
        retry_of: int | None = None
        turn_id: str | None = None
        if self.turns:
            prev = self.turns[-1]
            sent = prev.request.messages
            how = data.draw(st.sampled_from(ECHOES), label="echo")
            echo = echo_of(self.last, how, data.draw(st.booleans(), label="null content"))
            self.echoes[id(echo)] = (prev.number, echo)
            extra_user = bool(self.last.get("tool_calls")) and data.draw(st.booleans(), label="extra user")
            follow = data.draw(st.sampled_from(FOLLOW_UPS), label="follow-up")
            base = [*sent, echo, *follow_up(self.last, number, follow, extra_user)]
            action = data.draw(st.sampled_from(self.actions), label="action")
            event(f"echo: {how}")
            if action == "retry":
                kinds = ["same_turn_id"] if prev.turn_id is not None else []
                kind = data.draw(st.sampled_from([*kinds, "same_list", "same_list_other_id"]), label="retry")
                event(f"retry: {kind}" + (" of a segment's first turn" if prev.expected else ""))
                # The agent timed out and sends the same request again (copies of its dicts).
                messages = copy.deepcopy(sent)
                expected = prev.expected
                retry_of = len(self.turns) - 1
                turn_id = {"same_turn_id": prev.turn_id, "same_list": None}.get(kind, f"t{number}")
            else:
                messages, expected = self._changed(data, action, sent, base, echo, number)
        if retry_of is None and self.turn_ids:
            turn_id = data.draw(st.sampled_from([None, f"t{number}", f"t{number}"]), label="turn id")
        retried = self.turns[retry_of] if retry_of is not None else None
        thinking = self.enable_thinking is None
        stop_ok = retried is None or bool(retried.request.stop)
        reply = data.draw(replies(tokenizer, number, self.tools, thinking, stop_ok), label="reply")
        request = ChatRequest(
            messages=messages,
            tools=list(self.tools),
            max_tokens=512,
            enable_thinking=self.enable_thinking,
            stop=retried.request.stop if retried is not None else (reply.stop,) if reply.stop else (),
        )
        echoed = tuple(self.echoes[id(m)][0] for m in messages if id(m) in self.echoes)
        turn = Turn(number, request, reply, expected, turn_id, retry_of, echoed)
        self.turns.append(turn)
        return turn

    def _changed(
        self,
        data: st.DataObject,
        action: str,
        sent: list[dict[str, Any]],
        base: list[dict[str, Any]],
        echo: dict[str, Any],
        number: int,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The next request for ``action`` (not a retry), and the boundary it must give."""
        changes = {action} - {"continue"}
        if changes and data.draw(st.integers(0, 3), label="combine") == 0:
            # Two contract breaks in one request: the first one checked names the boundary.
            changes.add(data.draw(st.sampled_from(BREAKS), label="also"))
        event(f"changes: {sorted(changes)}")
        expected = next((b for b in BREAKS if b in changes), None)
        messages = base
        if "history_rewrite" in changes:
            start = max(i for i, t in enumerate(self.turns) if t.expected is not None)
            sampled_here = {len(t.request.messages) for t in self.turns[start:]}
            keep_first = "system_changed" in changes
            messages = rewrite(data, sent, base, number, keep_first, sampled_here)
        if "system_changed" in changes:
            # Only the system text changes: the first user message stays (else: a sub-agent).
            system = {"role": "system", "content": f"You are a terse assistant. Version {number}."}
            messages = [system, *messages[1:]]
        if "tool_schema_change" in changes:
            tools = self.tools
            absent = [t for t in TOOL_POOL if t not in tools]
            change = data.draw(st.sampled_from(["add", "remove", "reorder"]), label="tool change")
            if change == "reorder" and len(tools) >= 2:
                tools = [*tools[1:], tools[0]]
            elif tools and (change == "remove" or not absent):
                gone = data.draw(st.sampled_from(tools), label="removed")
                tools = [t for t in tools if t is not gone]
            else:
                tools = [*tools, data.draw(st.sampled_from(absent), label="added")]
            self.tools = tools
        # Never a retry (the previous request again) nor a cut-down copy with nothing new.
        assert messages != sent and messages != [*sent, echo][: len(messages)]
        return messages, expected


async def chat(runtime: Runtime, session_id: str, request: ChatRequest, turn_id: str | None = None) -> TurnResult:
    """One turn through the runtime with the whole request (stop strings)."""
    return await run_request(runtime, request, Identity(session_id, turn_id=turn_id))


async def play(runtime: Runtime, engine: SimEngine, session: str, conversation: Conversation, turn: Turn) -> None:
    """Script the engine for ``turn``, run it, and give the conversation our reply."""
    reply = turn.reply
    event("reply: " + ("length" if reply.truncated else "stop string" if reply.stop else "eot"))
    engine.script(ScriptedOutput(reply.ids, finish="length" if reply.truncated else "stop"))
    result = await chat(runtime, session, turn.request, turn.turn_id)
    assert result.done is not None, result.error
    turn.session_id = result.done.session_id
    conversation.last = result.message
    # The agent never sees the text from the stop string on.
    assert STOP not in json.dumps(conversation.last) and "rambles" not in json.dumps(conversation.last)


def _engine(tokenizer: ChatTokenizer) -> tuple[SimEngine, RecordingBackend]:
    engine = SimEngine(tokenizer, SimConfig(seed=11, token_interval=0))
    return engine, RecordingBackend(engine)


async def drive(
    data: st.DataObject,
    tokenizer: ChatTokenizer,
    *,
    config: ProxyConfig | None = None,
    actions: tuple[str, ...] = ACTIONS,
    turn_ids: bool = False,
    max_turns: int = 8,
) -> tuple[dict[str, Any], list[Turn], RecordingBackend]:
    """Run one generated session; returns what ``read`` gives after finalize, the turns, the backend."""
    engine, backend = _engine(tokenizer)
    session = "prop"
    n_turns = data.draw(st.integers(2, max_turns), label="turns")
    tools = data.draw(st.lists(st.sampled_from(TOOL_POOL), unique_by=_tool_name, max_size=2), label="tools")
    enable_thinking = data.draw(st.sampled_from([None, False]), label="enable_thinking")
    conversation = Conversation(
        [
            {"role": "system", "content": "You are a careful assistant. Version 0."},
            {"role": "user", "content": "Plan a trip and check the weather first."},
        ],
        tools,
        enable_thinking,
        actions=actions,
        turn_ids=turn_ids,
    )
    async with open_runtime(config or ProxyConfig.of(port=0), backend=backend, tokenizer=tokenizer) as runtime:
        for number in range(n_turns):
            await play(runtime, engine, session, conversation, conversation.next_turn(data, tokenizer, number))
        await runtime.finalize(session)
        payload = CONVERTER.unstructure(await runtime.read(session_id=session, include_steps=True))
    event(f"segments: {len(payload['data'])}")
    return payload, conversation.turns, backend


# -- the properties ------------------------------------------------------------------


def check_session(payload: dict[str, Any], turns: list[Turn], backend: RecordingBackend, tok: ChatTokenizer) -> None:
    """The properties of one session's segments and steps (``payload``), run from ``turns``."""
    segments, steps = payload["data"], payload["steps"]
    assert [s["step_index"] for s in steps] == list(range(len(turns)))
    session_ids = {t.session_id for t in turns}
    assert len(session_ids) == 1 and {s["session_id"] for s in steps} <= session_ids

    # 0. Retries: the re-sent turn replaced the previous generation, on the same prompt.
    retried_by = {t.retry_of: i for i, t in enumerate(turns) if t.retry_of is not None}
    for i, (step, turn) in enumerate(zip(steps, turns, strict=True)):
        assert step["retry_of"] == turn.retry_of
        if i in retried_by:
            assert step["status"] == "superseded" and step["in_segment"] is False
            assert step["superseded_by"] == retried_by[i]
        else:
            assert step["status"] == "completed" and step["superseded_by"] is None, step["status"]
        if turn.retry_of is not None:
            old = steps[turn.retry_of]
            assert backend.prompts[step["rid"]] == backend.prompts[old["rid"]]
            assert step["segment_index"] == old["segment_index"]
    live = [i for i in range(len(turns)) if i not in retried_by]

    # 1. The TITO contract of every segment.
    for segment in segments:
        check_segment_invariants(segment, steps, backend.prompts)

    # 2. Boundaries exactly where the generator broke the contract (a retry is none; a retried
    #    segment's first turn keeps its reason).
    expected = [t.expected for t in turns]
    assert [s["boundary_reason"] for s in steps] == expected
    opened = [turns[i].expected for i in live if turns[i].expected is not None]
    assert [s["start_reason"] for s in segments] == opened
    assert [s["boundary_reason"] for s in segments] == [*opened[1:], "finalize"]
    assert [s["segment_index"] for s in segments] == list(range(len(segments)))

    # 4. Every completed step is in exactly one segment, and segments take turns in order;
    #    a superseded step is in none.
    listed = [i for s in segments for i in s["step_indices"]]
    assert listed == live
    for segment in segments:
        assert segment["num_steps"] == len(segment["step_indices"])
        for i in segment["step_indices"]:
            assert steps[i]["in_segment"] and steps[i]["segment_index"] == segment["segment_index"]
        first = segment["step_indices"][0]
        if turns[first].retry_of is not None and turns[turns[first].retry_of].expected is not None:
            # A retry of a segment's first turn: still the segment's first turn, with its reason.
            assert segment["start_reason"] == turns[turns[first].retry_of].expected == turns[first].expected

    # 3. Sampled ids are kept as sampled, and never re-tokenized.
    for segment in segments:
        ids = segment["token_ids"]
        first = segment["step_indices"][0]
        for i in segment["step_indices"]:
            step, reply = steps[i], turns[i].reply
            out = step["output_ids"]
            emitted = list(backend.inner.stats(step["rid"]).token_ids)
            assert emitted == list(reply.ids)
            if reply.stop is None:
                assert out == emitted
            else:
                # Cut where the stop string appeared; the stop text itself stays sampled.
                assert out == emitted[: len(out)] and len(out) < len(emitted)
                assert reply.stop in tok.decode(out)
            start = step["prompt_tokens"]
            assert ids[start : start + len(out)] == out
            context = step["concat_context_token_count"]
            assert step["concat_token_ids"] == ids[start - context : start + len(out)]
            assert step["finish_reason"] == ("length" if reply.truncated else "stop")
        # A segment's first prompt is its whole conversation rendered once.
        request = turns[first].request
        text = tok.render(
            request.messages, tools=request.tools, add_generation_prompt=True, enable_thinking=request.enable_thinking
        )
        assert backend.prompts[steps[first]["rid"]].tolist() == tok.encode(text).tolist()
        assert steps[first]["concat_context_token_count"] == steps[first]["prompt_tokens"]
        indices = segment["step_indices"]
        for before, i in zip(indices, indices[1:], strict=False):
            step = steps[i]
            fragment = tok.decode(step["concat_token_ids"][: step["concat_context_token_count"]])
            for k in range(turns[i].number):
                assert marker(k) not in fragment, f"step {i}'s fragment re-tokenizes reply {k}: {fragment!r}"
            # Without a sampled <|im_end|> the fragment closes the reply itself; else it must not.
            assert fragment.startswith("<|im_end|>") == turns[before].reply.ends_open, fragment
            assert fragment.startswith(("<|im_end|>\n<|im_start|>", "\n<|im_start|>")), fragment
            assert "<|im_start|>assistant\n" in fragment.rsplit("<|im_end|>", 1)[-1], fragment


@PROPERTY_SETTINGS
@given(data=st.data())
async def test_generated_sessions_keep_tito_exact(data: st.DataObject, tokenizer: ChatTokenizer) -> None:
    payload, turns, backend = await drive(data, tokenizer)
    check_session(payload, turns, backend, tokenizer)


# -- retries ---------------------------------------------------------------------------

#: ``retry``: the previous request sent again (same turn id, or the same list with no or another id).
RETRY_ACTIONS = (*ACTIONS, "continue", "retry", "retry", "retry")


@PROPERTY_SETTINGS
@given(data=st.data())
async def test_generated_retries_replace_the_previous_generation(data: st.DataObject, tokenizer: ChatTokenizer) -> None:
    """Retries interleaved with continuations and rewrites: never a boundary, never trained twice."""
    payload, turns, backend = await drive(data, tokenizer, actions=RETRY_ACTIONS, turn_ids=True)
    event(f"retries: {sum(t.retry_of is not None for t in turns)}")
    check_session(payload, turns, backend, tokenizer)
    steps = payload["steps"]
    for i, turn in enumerate(turns):
        if turn.retry_of is not None:
            assert turn.retry_of == i - 1
            assert steps[i - 1]["superseded_by"] == i and steps[i]["retry_of"] == i - 1
            assert all(i - 1 not in s["step_indices"] for s in payload["data"])


# -- sub-agents -------------------------------------------------------------------------

SUB_SYSTEMS = (
    "You are a search sub-agent. Report what you find briefly.",
    "You are a code-review sub-agent. List the problems you see.",
)


@PROPERTY_SETTINGS
@given(data=st.data())
async def test_generated_sub_agents_get_their_own_child_sessions(data: st.DataObject, tokenizer: ChatTokenizer) -> None:
    """A main conversation and 1-3 sub-agents' conversations, interleaved in one session id."""
    engine, backend = _engine(tokenizer)
    session = "par"
    main = Conversation(
        [
            {"role": "system", "content": "You are a careful assistant. Version 0."},
            {"role": "user", "content": "Plan a trip and check the weather first."},
        ],
        data.draw(st.lists(st.sampled_from(TOOL_POOL), unique_by=_tool_name, max_size=2), label="tools"),
        data.draw(st.sampled_from([None, False]), label="enable_thinking"),
        actions=RETRY_ACTIONS,
        turn_ids=True,
    )
    n_subs = data.draw(st.integers(1, 3), label="sub-agents")
    conversations = [main]
    for n in range(n_subs):
        # Two sub-agents may share a system prompt; their tasks always differ.
        system = data.draw(st.sampled_from(SUB_SYSTEMS), label="sub-agent system")
        conversations.append(
            Conversation(
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Sub-task {n}: find where module_{n} is defined."},
                ],
                data.draw(st.lists(st.sampled_from(TOOL_POOL), unique_by=_tool_name, max_size=2), label="sub tools"),
                data.draw(st.sampled_from([None, False]), label="sub enable_thinking"),
                actions=("continue", "continue", "retry"),
                turn_ids=True,
            )
        )
    counts = [data.draw(st.integers(1, 4), label="main turns")]
    counts += [data.draw(st.integers(1, 3), label="sub turns") for _ in range(n_subs)]
    # The main agent speaks first (it is the session's main conversation); then any interleaving.
    rest = [who for who, count in enumerate(counts) for _ in range(count)][1:]
    order = [0, *data.draw(st.permutations(rest), label="interleaving")]
    event(f"sub-agents: {n_subs}")

    # --side-calls off: the first conversation is the main one even before it continues (with side
    # calls on, a sub-agent arriving before the main agent continued gets a lane; test_side_calls.py).
    config = ProxyConfig.of(port=0, side_calls="off")
    async with open_runtime(config, backend=backend, tokenizer=tokenizer) as runtime:
        for number, who in enumerate(order):
            conversation = conversations[who]
            await play(runtime, engine, session, conversation, conversation.next_turn(data, tokenizer, number))
        await runtime.finalize(session)
        payload = CONVERTER.unstructure(await runtime.read(session_id=session, include_steps=True))
        firsts = sorted(range(1, len(conversations)), key=order.index)
        children = {who: f"{session}/sub-{n}" for n, who in enumerate(firsts, 1)}
        child_reads = {who: CONVERTER.unstructure(await runtime.read(session_id=child, include_steps=True))
                       for who, child in children.items()}

    segments, steps = payload["data"], payload["steps"]
    session_of = {0: session, **children}
    assert all(s["parent_traj_id"] == session for s in segments)
    assert {s["session_id"] for s in steps} == set(session_of.values())
    total_segments = 0
    for who, conversation in enumerate(conversations):
        mine = session_of[who]
        assert {t.session_id for t in conversation.turns} == {mine}
        own = {
            "data": [s for s in segments if s["trajectory_id"].rpartition("#")[0] == mine],
            "steps": [s for s in steps if s["session_id"] == mine],
        }
        # Its segments and boundaries are exactly those of its own turns, whatever ran in between.
        check_session(own, conversation.turns, backend, tokenizer)
        total_segments += len(own["data"])
        if who == 0:
            assert all("sub_agent" not in s["metadata"] for s in own["data"])
            continue
        # A sub-agent's conversation: one child, one unbroken segment, finalized with the parent.
        (segment,) = own["data"]
        assert segment["start_reason"] == "session_start" and segment["boundary_reason"] == "finalize"
        assert segment["metadata"]["sub_agent"] == mine.rpartition("/")[2]
        assert child_reads[who] == own
    assert total_segments == len(segments)


# -- recompute mode ----------------------------------------------------------------------

RECOMPUTE_ACTIONS = ("continue", "history_rewrite", "history_rewrite", "system_changed", "tool_schema_change")


async def check_recompute(
    payload: dict[str, Any], turns: list[Turn], backend: RecordingBackend, tok: ChatTokenizer
) -> None:
    """``--on-history-rewrite recompute``: one segment, rebuilt in place at every contract break."""
    segments, steps = payload["data"], payload["steps"]
    assert [s["step_index"] for s in steps] == list(range(len(turns)))
    assert all(s["status"] == "completed" for s in steps)
    rebuilding = [i for i, t in enumerate(turns) if i > 0 and t.expected is not None]
    last = rebuilding[-1] if rebuilding else 0
    (segment,) = segments
    meta = segment["metadata"]
    assert segment["start_reason"] == "session_start" and segment["boundary_reason"] == "finalize"
    assert segment["step_indices"] == list(range(last, len(turns)))
    if rebuilding:
        assert meta["rebuilds"] == [turns[i].expected for i in rebuilding]
        assert meta["rebuilt_steps"] == list(range(last))
    else:
        assert "rebuilds" not in meta and "rebuilt_steps" not in meta
    assert [s["in_segment"] for s in steps] == [i >= last for i in range(len(turns))]
    assert [s["boundary_reason"] for s in steps] == [t.expected for t in turns]
    assert [s["prefix_rebuilt"] for s in steps] == [i in rebuilding for i in range(len(turns))]

    # Every rebuilding step: the rewritten conversation rendered afresh, our replies still in it
    # marked and scored with the engine's prompt logprobs of that very prompt.
    for i in rebuilding:
        step, request = steps[i], turns[i].request
        prompt = backend.prompts[step["rid"]]
        n = len(prompt)
        text = tok.render(
            request.messages, tools=request.tools, add_generation_prompt=True, enable_thinking=request.enable_thinking
        )
        assert prompt.tolist() == tok.encode(text).tolist()
        assert step["prompt_tokens"] == step["concat_context_token_count"] == n
        assert step["concat_token_ids"][:n] == prompt.tolist()
        spans = step["rebuilt_spans"]
        event(f"replies kept by a rebuild: {min(len(spans), 3)}{'+' if len(spans) >= 3 else ''}")
        assert len(spans) == len(turns[i].echoed), (spans, turns[i].echoed)
        for (a, b), k in zip(spans, turns[i].echoed, strict=True):
            body = tok.decode(prompt[a:b])
            assert body.endswith("<|im_end|>") and body.count("<|im_end|>") == 1, body
            body = body.removesuffix("<|im_end|>")
            output = steps[k]["output"]
            assert (output["content"] or "").strip() in body, (output, body)
            for call in output["tool_calls"] or ():
                assert call["function"]["name"] in body and marker(k) in body, body
            assert [j for j in range(turns[i].number) if marker(j) in body] in ([], [k]), body
        assert [a for a, b in spans] == sorted(a for a, b in spans)
        positions = [p for a, b in spans for p in range(a, b)]
        mask, logprobs = step["concat_response_mask"], step["concat_response_logprobs"]
        assert [p for p in range(n) if mask[p]] == positions
        values = await backend.prompt_logprobs(prompt)
        assert [logprobs[p] for p in positions] == [values[p] for p in positions]
        assert all(step["concat_versions"][p] == 0 for p in positions)
        assert step["logprobs_recomputed"] is bool(spans) and step["concat_logprobs_invalid"] is False

    # The segment: the last rebuild's fragment, then the in-segment steps back to back.
    ids, mask, logprobs, versions = (segment[k] for k in ("token_ids", "loss_mask", "logprobs", "versions"))
    assert len(ids) == len(mask) == len(logprobs) == len(versions)
    spans = steps[last]["rebuilt_spans"] if rebuilding else []
    assert meta["recomputed_logprob_spans"] == spans
    assert meta["invalid_logprob_spans"] == [] and meta["logprobs_invalid"] is False
    trained = [p for a, b in spans for p in range(a, b)]
    if spans:
        values = await backend.prompt_logprobs(backend.prompts[steps[last]["rid"]])
        assert [logprobs[p] for p in trained] == [values[p] for p in trained]
    for i in segment["step_indices"]:
        step = steps[i]
        seen = backend.prompts[step["rid"]].tolist()
        start, out = step["prompt_tokens"], step["output_ids"]
        assert ids[:start] == seen, f"step {i}: prompt is not a prefix of the segment"
        assert ids[start : start + len(out)] == out and logprobs[start : start + len(out)] == step["output_logprobs"]
        trained.extend(range(start, start + len(out)))
        if i > last:
            fragment = tok.decode(step["concat_token_ids"][: step["concat_context_token_count"]])
            assert not [k for k in range(i) if marker(k) in fragment], fragment
    assert [p for p, m in enumerate(mask) if m] == trained
    for p, m in enumerate(mask):
        if m:
            assert logprobs[p] <= 0.0 and versions[p] == 0
        else:
            assert logprobs[p] == 0.0 and versions[p] == -1


@PROPERTY_SETTINGS
@given(data=st.data())
async def test_generated_rewrites_rebuild_in_place_in_recompute_mode(
    data: st.DataObject, tokenizer: ChatTokenizer
) -> None:
    config = ProxyConfig.of(port=0, on_history_rewrite="recompute")
    payload, turns, backend = await drive(data, tokenizer, config=config, actions=RECOMPUTE_ACTIONS)
    event(f"rebuilds: {len(payload['data'][0]['metadata'].get('rebuilds', []))}")
    await check_recompute(payload, turns, backend, tokenizer)


async def test_in_place_edit_of_an_earlier_message_is_a_history_rewrite(tokenizer: ChatTokenizer) -> None:
    engine = SimEngine(tokenizer, SimConfig(token_interval=0))
    engine.script("First answer.", "Second answer.")
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "Plan a trip."},
        ]
        first = await chat(runtime, "mut", ChatRequest(messages=list(messages)))
        # The agent appends a reminder to its first message in place (same dict), then goes on.
        messages[1]["content"] += "\n\n<system-reminder>\nThe date changed.\n</system-reminder>"
        messages += [first.message, {"role": "user", "content": "And then?"}]
        second = await chat(runtime, "mut", ChatRequest(messages=messages))
        assert second.done is not None
        await runtime.finalize("mut")
        payload = CONVERTER.unstructure(await runtime.read(session_id="mut", include_steps=True))
    # What the engine saw for the second turn must hold the reminder the agent sent.
    assert [s["boundary_reason"] for s in payload["steps"]] == ["session_start", "history_rewrite"]
