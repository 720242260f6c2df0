"""OpenAI Responses API wire format (sans-IO): input items in, a response object and typed SSE events out.

Codex CLI and the Agents SDK speak only this API. A body converts to the same
:class:`ChatRequest` the chat-completions path builds for the equivalent chat
conversation, so both record the same tokens:

- ``instructions`` becomes a leading system message; ``developer`` and
  ``system`` messages become system messages, ``user`` messages user messages
  (text parts joined with ``\\n``, as the chat template joins them);
- a run of ``reasoning``, assistant ``message`` and ``function_call`` items
  (the output of one response) becomes one assistant message with
  ``reasoning_content``, ``content`` and ``tool_calls``;
- ``function_call_output`` becomes a ``tool`` message;
- function tools (flat: ``{"type": "function", "name", "parameters"}``)
  become chat function tools, and so do the function tools of a ``namespace``
  tool, by their own names (a call of one goes back with its ``namespace``);
  hosted tools (``web_search``, ...) are not offered to the model, since their
  server would run them and this one cannot.

``previous_response_id`` is resolved within the session by a
:class:`ResponseHistory` the app keeps; ``store: false`` clients send the
whole conversation every time. An ``item_reference`` names an output item of a
stored response (the Vercel AI SDK refers to earlier reasoning and text that
way): :class:`IssuedItems` resolves it to the item as it was sent, within its session.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import attrs

from ..core.messages import AssistantOutput, output_as_message
from ..core.requests import ChatRequest, offered_tools
from ..errors import BadRequest
from ..schema.converter import structure
from ..schema.jsonio import dumps, loads
from .responses_types import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    Item,
    MessageItem,
    NamespaceTool,
    Part,
    ReasoningItem,
    RefusalPart,
    ResponsesOptions,
    ResponsesRequest,
    TextPart,
    Tool,
)

#: The prefix of the ``encrypted_content`` we hand out: the reasoning text, base64, so an echo restores it.
ENCRYPTED_PREFIX = "actorproxy-b64:"


@attrs.frozen
class ResponsesCall:
    """A validated ``/v1/responses`` body; ``request`` lacks what ``previous_response_id`` adds."""

    request: ChatRequest
    model: str
    stream: bool
    previous_response_id: str | None
    #: ``store: false``: the response cannot be continued by id (the client resends the input).
    store: bool
    #: The client asked for ``reasoning.encrypted_content`` (stateless reasoning round trips).
    include_encrypted: bool
    #: Fields echoed in the response object as the client sent them.
    echo: dict[str, Any]
    #: Their JSON members, each after a comma, as the response object carries them (:func:`echo_parts`; the
    #: tools as their text was sent, so not compared: ``echo`` is).
    echo_json: bytes = attrs.field(eq=False)
    session_id: str | None
    #: ``request.messages`` starts with the system message made of ``instructions``.
    has_instructions: bool = False
    #: The client asked for ``message.output_text.logprobs``: the sampled tokens' logprobs.
    logprobs: bool = False
    #: ``(item id, session)`` of each ``item_reference`` resolved in ``input``: checked against the
    #: turn's session once it is known.
    references: tuple[tuple[str, str], ...] = ()

    def own_messages(self) -> list[dict[str, Any]]:
        """The input's messages without ``instructions`` (which a later response does not inherit)."""
        return self.request.messages[1:] if self.has_instructions else self.request.messages

    def continuing(self, history: list[dict[str, Any]]) -> ChatRequest:
        """The request with the conversation of ``previous_response_id`` before its input."""
        head = self.request.messages[:1] if self.has_instructions else []
        return attrs.evolve(self.request, messages=[*head, *history, *self.own_messages()])


# -- request ------------------------------------------------------------------------


def _text(parts: str | list[Part] | None, *, joiner: str = "\n") -> str:
    """The text of a string or of parts already checked to be text or refusal parts."""
    if parts is None or isinstance(parts, str):
        return parts or ""
    return joiner.join(part.text if isinstance(part, TextPart) else cast(RefusalPart, part).refusal
                       for part in parts)


def decode_reasoning(item: ReasoningItem, where: str) -> str:
    """The reasoning text of an echoed ``reasoning`` item: its ``content``, else our ``encrypted_content``.

    A summary is not the reasoning itself; an item with neither text is dropped (as
    chat clients drop ``reasoning_content``).
    """
    if item.content:
        return _text(item.content, joiner="")
    encrypted = item.encrypted_content
    if isinstance(encrypted, str) and encrypted.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(encrypted[len(ENCRYPTED_PREFIX) :], validate=True).decode()
        except ValueError:
            where = f"{where}.encrypted_content"
            raise BadRequest(f"{where} is not one this proxy issued", param=where) from None
    return ""


class _Assistant:
    """One assistant turn being assembled from consecutive output items."""

    #: The order our own output has: a later kind may follow an earlier one in the same turn.
    _ORDER = {"reasoning": 0, "message": 1, "function_call": 2}

    def __init__(self) -> None:
        self.stage = -1
        self.reasoning: list[str] = []
        self.texts: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def accepts(self, kind: str) -> bool:
        # Reasoning after text or calls, or text after calls, begins a new turn.
        return self._ORDER[kind] >= self.stage and not (kind != "function_call" and self.stage == 2)

    def add_part(self, kind: str, part: Any) -> None:
        """A converted part (:func:`assistant_part`) of this turn."""
        self.stage = max(self.stage, self._ORDER[kind])
        if kind == "reasoning":
            self.reasoning.append(part)
        elif kind == "message":
            self.texts.append(part)
        else:
            self.calls.append(part)

    def message(self) -> dict[str, Any]:
        # Texts are joined with "" as the Anthropic path does: a reply streamed in parts echoes whole.
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(self.texts) if self.texts or not self.calls else None}
        if any(self.reasoning):
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def assistant_part(item: Item, where: str) -> Any:
    """An output item of an assistant turn converted: its reasoning or text, or its tool call."""
    if isinstance(item, ReasoningItem):
        return decode_reasoning(item, where)
    if isinstance(item, MessageItem):
        return _text(item.content, joiner="")
    call = cast(FunctionCallItem, item)
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def item_kind(item: Item) -> tuple[str, bool]:
    """An input item's kind, and whether it is part of an assistant turn (reasoning, message, function_call)."""
    if isinstance(item, MessageItem):
        return "message", item.role == "assistant"
    return item.type, isinstance(item, ReasoningItem | FunctionCallItem)


def other_message(item: Item) -> dict[str, Any]:
    """An input item that is not part of an assistant turn, as its chat message."""
    if isinstance(item, MessageItem):
        return {"role": "user" if item.role == "user" else "system", "content": _text(item.content)}
    output = cast(FunctionCallOutputItem, item)
    if output.call_id:
        return {"role": "tool", "tool_call_id": output.call_id, "content": _text(output.output)}
    return {"role": "tool", "content": _text(output.output)}


def convert_input(items: str | list[Item]) -> list[dict[str, Any]]:
    """Responses ``input`` (typed) as the chat messages the template renders (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    parts = []
    for i, item in enumerate(items):
        kind, assistant = item_kind(item)
        parts.append((kind, assistant_part(item, f"input[{i}]") if assistant else other_message(item), assistant))
    return assemble_input(parts)


def turn_end(parts: Sequence[tuple[Any, Any, bool]], start: int) -> int:
    """Where the assistant turn whose first part is ``parts[start]`` ends (as :func:`assemble_input` groups)."""
    turn = _Assistant()
    end = start
    while end < len(parts) and parts[end][2] and turn.accepts(parts[end][0]):
        turn.stage = max(turn.stage, turn._ORDER[parts[end][0]])
        end += 1
    return end


def assemble_input(parts: Iterable[tuple[Any, Any, bool]]) -> list[dict[str, Any]]:
    """The chat messages of converted items ``(kind, part or message, part of an assistant turn)``:
    a run of assistant parts becomes one assistant message."""
    messages: list[dict[str, Any]] = []
    turn: _Assistant | None = None
    for kind, converted, assistant in parts:
        if assistant:
            if turn is None or not turn.accepts(kind):
                if turn is not None:
                    messages.append(turn.message())
                turn = _Assistant()
            turn.add_part(kind, converted)
            continue
        if turn is not None:
            messages.append(turn.message())
            turn = None
        messages.append(converted)
    if turn is not None:
        messages.append(turn.message())
    return messages


def convert_tools(tools: list[Any] | None, typed: list[Tool] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """Function tools as chat tools (a namespace's too, by their own names), and the kinds of the other tools (not
    offered to the model).

    ``typed`` is ``tools`` structured (checked); the chat tools are made of the tools as sent, so the
    prompt lists each as its client wrote it. A namespace's function named as another offered function is a
    :class:`BadRequest`: a call of it could not say which it is.
    """
    converted: list[dict[str, Any]] = []
    skipped: list[str] = []
    #: Each offered function's name: whether a namespace offers it.
    offered: dict[str, bool] = {}

    def offer(function: dict[str, Any], namespaced: bool, where: str) -> None:
        name = function["name"]
        if name in offered and (namespaced or offered[name]):
            raise BadRequest(f"{where}.name: {name!r} is offered twice, and one of them is a namespace's function: "
                             "this proxy offers a namespace's functions by their own names", param="tools")
        offered[name] = namespaced  # (a name seen before was two flat functions': offered as sent)
        converted.append({"type": "function", "function": function})

    for i, (tool, checked) in enumerate(zip(tools or [], typed or [], strict=True)):
        if isinstance(checked, NamespaceTool):
            for j, (member, inner) in enumerate(zip(tool.get("tools") or [], checked.tools, strict=True)):
                if isinstance(inner, FunctionTool) and inner.function is None:
                    offer(_flat_function(member), True, f"tools[{i}].tools[{j}]")
                else:
                    skipped.append(f"{checked.name}.{inner.type}")
        elif not isinstance(checked, FunctionTool):
            skipped.append(checked.type)
        elif checked.function is not None:  # the chat shape, sent by some clients
            offer(tool["function"], False, f"tools[{i}].function")
        else:
            offer(_flat_function(tool), False, f"tools[{i}]")
    return converted, skipped


def _flat_function(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A flat function tool's chat ``function``: its fields as sent."""
    return {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}


def tool_namespaces(tools: Any) -> dict[str, str]:
    """``{function name: namespace}`` of the function tools a ``namespace`` tool offers, in ``tools`` as sent
    (checked already: :func:`convert_tools`)."""
    found: dict[str, str] = {}
    for tool in tools or ():
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            for member in tool.get("tools") or ():
                if isinstance(member, dict) and member.get("type") == "function" and "function" not in member:
                    found[member["name"]] = tool["name"]
    return found


#: The ``include`` entry that asks for the sampled tokens' logprobs (and ``top_logprobs``' alternatives).
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def instructions_message(options: ResponsesOptions) -> dict[str, Any] | None:
    """The system message ``instructions`` make (none when absent or empty)."""
    text = _text(options.instructions)
    return {"role": "system", "content": text} if text else None


def offers_tools(options: ResponsesOptions) -> bool:
    """Whether the prompt lists the body's function tools: not when its tool choice is ``"none"``."""
    return bool(options.tool_choice != "none")


def responses_request(
    options: ResponsesOptions, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> ChatRequest:
    """The request a Responses body's typed fields ask for, with these messages and (converted) tools."""
    effort = None if options.reasoning is None else options.reasoning.effort
    return ChatRequest(
        messages=messages,
        tools=offered_tools(tools, not offers_tools(options)),
        max_tokens=options.max_output_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        enable_thinking=None if effort is None else effort != "none",
        stream=bool(options.stream),
        # Listed with the logprobs, which only ``include`` asks for.
        top_logprobs=(options.top_logprobs or 0) if LOGPROBS_INCLUDE in (options.include or ()) else 0,
    )


def echoed(body: Mapping[str, Any], options: ResponsesOptions) -> dict[str, Any]:
    """The fields the response object echoes, as ``body`` (the request's JSON value, ``input`` aside) sent them."""
    echo = {key: body.get(key) for key in ("instructions", "metadata", "reasoning", "text", "truncation")}
    echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice") or "auto",
                parallel_tool_calls=body.get("parallel_tool_calls", True), max_output_tokens=options.max_output_tokens,
                temperature=body.get("temperature"), top_p=body.get("top_p"),
                previous_response_id=options.previous_response_id or None, store=options.store is not False)
    return echo


def echo_parts(echo: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """The echoed fields' JSON members (each after a comma) before ``tools``, ``"tools":`` last, and after it.

    Made once while the fields repeat (``responses_memo.ResponsesFields``): a response's echo is these around
    the tools' JSON text.
    """
    before: list[bytes] = []
    after: list[bytes] = []
    side = before
    for key, value in echo.items():
        if key == "tools":
            side = after
        else:
            side.append(b"," + dumps(key) + b":" + dumps(value))
    return b"".join(before) + b',"tools":', b"".join(after)


def parse_responses_body(
    body: Any, *, made: ChatRequest | None = None, echo: dict[str, Any] | None = None, echo_json: bytes = b""
) -> ResponsesCall:
    """Validate a Responses body; raise :class:`BadRequest` naming the bad field. Unknown fields are ignored.

    The body is structured by the one converter into :class:`ResponsesRequest`. ``made`` and
    ``echo``, when given, are the request the body asks for and the fields its response echoes,
    made already from what its parts were converted to (``responses_memo``): the body is then its
    other fields, typed already (:class:`ResponsesOptions`), and ``echo_json`` the echo's JSON members.
    """
    options: ResponsesOptions
    if made is None or echo is None:
        typed = structure(body, ResponsesRequest)
        options, messages = typed, convert_input(typed.input)
        system = instructions_message(typed)
        if system is not None:
            messages.insert(0, system)
        made = responses_request(typed, messages, convert_tools(body.get("tools"), typed.tools)[0])
        echo = echoed(body, typed)
        head, tail = echo_parts(echo)
        echo_json = head + dumps(echo["tools"]) + tail
    else:
        options = body
    include = options.include or []
    return ResponsesCall(
        request=made, model=str(options.model or ""), stream=made.stream,
        previous_response_id=echo["previous_response_id"], store=echo["store"],
        include_encrypted="reasoning.encrypted_content" in include, echo=echo, echo_json=echo_json,
        session_id=options.session_id or None, has_instructions=bool(_text(options.instructions)),
        logprobs=LOGPROBS_INCLUDE in include,
    )


# -- the conversation behind previous_response_id --------------------------------------


@attrs.frozen
class Issued:
    """An output item of a response as the reply sent it: its id and its JSON text."""

    id: str
    json: bytes


class _Stored:
    """A stored response: its parent, and the messages it added: its input (without instructions) and its output.

    The output is kept as the turn gave it and made the assistant message when a later request first continues
    from this response (:meth:`messages`), not on the path of every stored turn.
    """

    __slots__ = ("_input", "_messages", "_output", "parent")

    def __init__(self, parent: str | None, input_messages: Iterable[dict[str, Any]], output: AssistantOutput) -> None:
        self.parent = parent
        self._input: tuple[dict[str, Any], ...] = tuple(input_messages)
        self._output: AssistantOutput | None = output
        self._messages: tuple[dict[str, Any], ...] | None = None

    def messages(self) -> tuple[dict[str, Any], ...]:
        if self._messages is None:
            assert self._output is not None
            self._messages = (*self._input, output_as_message(self._output))
            self._input, self._output = (), None
        return self._messages


class IssuedItems:
    """The output items of stored responses, by id, for ``item_reference`` input items.

    Item ids are unique (they derive from the response id), so a reference is found
    without its session; the session it belongs to is kept and checked once the turn's
    session is known (:meth:`check`). At most ``capacity`` items are kept (least recently
    used go first); an unknown or evicted id is a 400 naming it. Items are kept as the
    reply wrote them, JSON text (held by reference, not copies), and parsed only when a
    later request names one.
    """

    def __init__(self, capacity: int = 1 << 17) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, tuple[str, bytes]] = OrderedDict()

    def add(self, session: str, items: Iterable[Issued]) -> None:
        for item in items:
            self._items[item.id] = (session, item.json)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def resolve(self, body: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
        """``body`` with each ``item_reference`` of its ``input`` replaced by the item it names."""
        items = body.get("input")
        if not isinstance(items, list) or not any(
            isinstance(item, dict) and item.get("type") == "item_reference" for item in items
        ):
            return body, ()
        resolved, references = [], []
        for i, item in enumerate(items):
            if not (isinstance(item, dict) and item.get("type") == "item_reference"):
                resolved.append(item)
                continue
            item_id = item.get("id")
            where = f"input[{i}].id"
            if not isinstance(item_id, str):
                raise BadRequest(f"{where} must be a string", param=where)
            found = self._items.get(item_id)
            if found is None:
                raise BadRequest(f"{where}: item {item_id!r} is not known (not an output of a response stored "
                                 "by this proxy, or expired): send the item itself", param=where,
                                 code="item_not_found")
            self._items.move_to_end(item_id)
            references.append((item_id, found[0]))
            resolved.append(loads(found[1], check=False))
        return {**body, "input": resolved}, tuple(references)

    @staticmethod
    def check(call: ResponsesCall, session: str) -> None:
        """A reference to another session's item is refused as unknown (sessions do not see each other)."""
        for item_id, owner in call.references:
            if owner != session:
                raise BadRequest(f"item {item_id!r} is not known in session {session!r}: send the item itself",
                                 param="input", code="item_not_found")


class ResponseHistory:
    """The conversations of stored responses, by ``(session, response id)``, for ``previous_response_id``.

    Each entry holds only what its response added and a link to its parent, so a
    conversation costs memory once, not once per turn. At most ``capacity``
    responses are kept (least recently used go first); an evicted id is a 400.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, str], _Stored] = OrderedDict()

    def conversation(self, session: str, response_id: str) -> list[dict[str, Any]]:
        """The messages up to and including ``response_id``'s output; :class:`BadRequest` if unknown."""
        chain: list[tuple[dict[str, Any], ...]] = []
        key: str | None = response_id
        while key is not None:
            entry = self._entries.get((session, key))
            if entry is None:
                raise BadRequest(
                    f"previous response {key!r} is not known in session {session!r} (sent with store: false, "
                    "from another session, or expired): send the whole conversation as input",
                    param="previous_response_id", code="previous_response_not_found")
            self._entries.move_to_end((session, key))
            chain.append(entry.messages())
            key = entry.parent
        return [message for messages in reversed(chain) for message in messages]

    def add(self, session: str, response_id: str, parent: str | None, messages: Iterable[dict[str, Any]],
            output: AssistantOutput) -> None:
        """Store a response: the input ``messages`` it added (without instructions) and its ``output``."""
        self._entries[(session, response_id)] = _Stored(parent, messages, output)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
