"""Replay the agent-trace corpus (``tests/traces/*.json``) over real HTTP.

Each trace runs against its own proxy (hypercorn on a loopback port) in front
of a simulated engine scripted, call by call, with exactly the text the trace
says the model sampled. After the last turn the session is finalized and read
back with its steps; the trace's expectations and the universal invariants
are checked. The format is described in ``tests/traces/README.md``; the files
are written by ``tests/traces/build_corpus.py``.
"""

from __future__ import annotations

import copy
import json
from array import array
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from _util import assemble_chat_stream, chat_chunks, check_segment_invariants

from actorproxy import ProxyConfig, open_proxy
from actorproxy.engines.base import GenerateRequest, Generation, ModelInfo
from actorproxy.protocols.anthropic import convert_messages, convert_tools
from actorproxy.protocols.anthropic_types import MessagesRequest
from actorproxy.schema.converter import structure
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization.tokenizer import ChatTokenizer

TRACES = Path(__file__).parents[1] / "traces"
TRACE_FILES = sorted(TRACES.glob("[0-9][0-9]_*.json"))
CORPUS = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in TRACE_FILES}


# -- the engine --------------------------------------------------------------------


@attrs.define
class Recorder:
    """The simulated engine, remembering every request's prompt ids and routing key.

    Anything else (``prompt_logprobs``, ``kind``, weight-version hooks) goes to the engine.
    """

    inner: SimEngine
    prompts: dict[str, array[int]] = attrs.field(factory=dict)
    routing: list[tuple[str, str | None]] = attrs.field(factory=list)

    @property
    def kind(self) -> str:
        return "sim"

    def open_generation(self, request: GenerateRequest) -> AbstractAsyncContextManager[Generation]:
        self.prompts[request.rid] = array("i", request.input_ids)
        self.routing.append((request.rid, request.routing_key))
        return self.inner.open_generation(request)

    async def model_info(self) -> ModelInfo:
        return await self.inner.model_info()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_TOKENIZERS: dict[str, ChatTokenizer] = {}


def tokenizer_for(trace: dict[str, Any], builtin: ChatTokenizer) -> ChatTokenizer:
    """The built-in qwen3 tokenizer, or a fresh copy with a patched chat template."""
    spec = trace.get("tokenizer")
    if not spec:
        return builtin
    key = json.dumps(spec, sort_keys=True)
    if key not in _TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        from actorproxy.tokenization.qwen3 import qwen3_tokenizer_file

        patch = spec["template_patch"]
        template = builtin.hf.chat_template
        assert template.count(patch["after"]) == 1, "the template patch no longer applies"
        template = template.replace(patch["after"], patch["after"] + patch["insert"])
        hf = PreTrainedTokenizerFast(tokenizer_file=str(qwen3_tokenizer_file()), eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")  # type: ignore[no-untyped-call]
        _TOKENIZERS[key] = ChatTokenizer(hf, name="qwen3-patched", chat_template=template)
    return _TOKENIZERS[key]


# -- requests and replies ------------------------------------------------------------------


def resolve_bodies(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Every turn's full request body (``body_extends`` expanded)."""
    bodies: list[dict[str, Any]] = []
    for turn in trace["turns"]:
        body = copy.deepcopy(turn["body"])
        if "body_extends" in turn:
            base = copy.deepcopy(bodies[turn["body_extends"]])
            base.update({k: v for k, v in body.items() if k != "messages"})
            base["messages"] = base["messages"] + body["messages"]
            body = base
        bodies.append(body)
    return bodies


def _sse_data(text: str) -> Iterator[str]:
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                yield line[len("data: "):]


def openai_reply(response: httpx.Response, stream: bool) -> dict[str, Any]:
    """An OpenAI reply, streamed or not, as {content, reasoning, tool_calls, finish, step_index, session_id}."""
    if not stream:
        data = response.json()
        message = data["choices"][0]["message"]
        assert message["role"] == "assistant"
        return {
            "content": message.get("content") or "",
            "reasoning": message.get("reasoning_content") or "",
            "tool_calls": _openai_calls(message.get("tool_calls") or []),
            "finish": data["choices"][0]["finish_reason"],
            "step_index": data["actorproxy"]["step_index"],
            "session_id": data["actorproxy"]["session_id"],
        }
    assert response.headers["content-type"].startswith("text/event-stream")
    streamed = assemble_chat_stream(chat_chunks(response.text))
    return {"content": streamed["content"], "reasoning": streamed["reasoning"],
            "tool_calls": _openai_calls(streamed["calls"]), "finish": streamed["finish"]}


def _openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": c["id"], "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in calls]


def anthropic_reply(response: httpx.Response, stream: bool) -> dict[str, Any]:
    """An Anthropic reply, streamed or not, in the same normal form."""
    if not stream:
        data = response.json()
        blocks = data["content"]
        finish = data["stop_reason"]
        extra = {"step_index": data["actorproxy"]["step_index"], "session_id": data["actorproxy"]["session_id"]}
    else:
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks, finish, extra = [], None, {}
        partial: dict[int, str] = {}
        for frame in _sse_data(response.text):
            event = json.loads(frame)
            kind = event["type"]
            assert kind != "error", event
            if kind == "content_block_start":
                assert event["index"] == len(blocks)
                blocks.append(dict(event["content_block"]))
            elif kind == "content_block_delta":
                block, delta = blocks[event["index"]], event["delta"]
                if delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                elif delta["type"] == "signature_delta":
                    block["signature"] = delta["signature"]
                elif delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "input_json_delta":
                    partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
            elif kind == "message_delta":
                finish = event["delta"]["stop_reason"]
        for index, text in partial.items():
            blocks[index]["input"] = json.loads(text)
    for block in blocks:
        if block["type"] == "thinking":
            assert block["signature"], "an unsigned thinking block would be dropped by clients"
    return {
        "content": "".join(b["text"] for b in blocks if b["type"] == "text"),
        "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
        "tool_calls": [{"id": b["id"], "name": b["name"], "arguments": b["input"]}
                       for b in blocks if b["type"] == "tool_use"],
        "finish": finish,
        **extra,
    }


def echoed_ids(api: str, body: dict[str, Any]) -> set[str]:
    """Tool-call ids a request refers to: echoed calls and tool results."""
    ids: set[str] = set()
    for message in body.get("messages", []):
        content = message.get("content")
        if api == "openai":
            ids.update(c["id"] for c in message.get("tool_calls") or [] if c.get("id"))
            if message.get("role") == "tool":
                ids.add(message["tool_call_id"])
        elif isinstance(content, list):
            for block in content:
                if block.get("type") == "tool_use":
                    ids.add(block["id"])
                elif block.get("type") == "tool_result":
                    ids.add(block["tool_use_id"])
    return ids


def request_chat(api: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chat messages and tools a body renders (Anthropic bodies converted as the proxy does)."""
    if api == "anthropic":
        typed = structure(body, MessagesRequest)
        return convert_messages(typed.system, typed.messages), convert_tools(typed.tools)
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]]
    return messages, body.get("tools") or []


def check_error(api: str, response: httpx.Response, expected: dict[str, Any]) -> None:
    """A refused request: the status, and a body in the caller's own error format."""
    body = response.json()
    if api == "anthropic":
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        error = body["error"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        error = body["error"]
    assert error["message"]
    for key, value in expected.items():
        assert error[key] == value, (key, error)


# -- replay ------------------------------------------------------------------------


@asynccontextmanager
async def serving(trace: dict[str, Any], tokenizer: ChatTokenizer) -> AsyncIterator[tuple[httpx.AsyncClient, Recorder]]:
    engine = SimEngine(tokenizer, SimConfig(seed=11, token_interval=0.0))
    backend = Recorder(engine)
    config = ProxyConfig.of(port=0, **trace["config"])
    async with (
        open_proxy(config, backend=backend, tokenizer=tokenizer) as running,  # type: ignore[arg-type]
        httpx.AsyncClient(base_url=running.url, timeout=60) as http,
    ):
        yield http, backend


async def replay(
    trace: dict[str, Any], http: httpx.AsyncClient, backend: Recorder
) -> tuple[list[dict[str, Any]], dict[tuple[str, int], int]]:
    """Send every turn; check each reply; return the bodies and (session, step) → turn index."""
    bodies = resolve_bodies(trace)
    returned_ids: set[str] = set()
    step_turn: dict[tuple[str, int], int] = {}
    for i, (turn, body) in enumerate(zip(trace["turns"], bodies, strict=True)):
        where = f"turn {i} ({turn.get('note') or turn['path']})"
        api, expect = turn["api"], turn["expect"]
        # Corpus consistency: every id the agent echoes was returned by the proxy earlier.
        unknown = echoed_ids(api, body) - returned_ids
        assert not unknown, f"{where}: echoes tool-call ids the proxy never returned: {unknown}"
        if isinstance(turn["engine"], list):  # pieces, each tokenized on its own
            ids = [tid for piece in turn["engine"] for tid in backend.inner.tokenizer.encode(piece)]
            backend.inner.script([*ids, backend.inner.tokenizer.eot_token_id], routing_key=turn["engine_session"])
        elif turn["engine"] is not None:
            backend.inner.script(turn["engine"], routing_key=turn["engine_session"])
        before = len(backend.routing)
        content = json.dumps(body, ensure_ascii=False).encode()
        response = await http.post(turn["path"], content=content,
                                   headers={"content-type": "application/json", **turn["headers"]})
        assert response.status_code == expect["status"], f"{where}: {response.status_code} {response.text[:500]}"
        keys = [key for _, key in backend.routing[before:]]
        if turn["engine"] is None:
            check_error(api, response, expect.get("error", {}))
            assert keys == [], f"{where}: a refused request reached the engine"
            continue
        assert keys == [turn["engine_session"]], (
            f"{where}: expected one engine call for session {turn['engine_session']!r}, got {keys}")
        stream = bool(body.get("stream"))
        reply = (openai_reply if api == "openai" else anthropic_reply)(response, stream)
        assert {k: reply[k] for k in expect["reply"]} == expect["reply"], f"{where}: reply differs"
        if "step_index" in reply:
            assert reply["step_index"] == expect["step_index"], where
            assert reply["session_id"] == expect.get("session_id", trace["session"]), where
        returned_ids.update(call["id"] for call in reply["tool_calls"])
        step_turn[(turn["engine_session"], expect["step_index"])] = i
    return bodies, step_turn


def _session_of(segment: dict[str, Any]) -> str:
    return str(segment["trajectory_id"]).rsplit("#", 1)[0]


def check_data(
    trace: dict[str, Any],
    payload: dict[str, Any],
    backend: Recorder,
    bodies: list[dict[str, Any]],
    step_turn: dict[tuple[str, int], int],
    tokenizer: ChatTokenizer,
) -> None:
    """The trace's expectations and the universal invariants on what was read back."""
    expect, config = trace["expect"], trace["config"]
    segments: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for segment in payload["data"]:
        segments[_session_of(segment)].append(segment)
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for step in payload["steps"]:
        steps[step["session_id"]].append(step)
    for group in segments.values():
        group.sort(key=lambda x: int(x["segment_index"]))
    for group in steps.values():
        group.sort(key=lambda x: int(x["step_index"]))

    # Segments: which, why, with which steps.
    wanted: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in expect["segments"]:
        wanted[entry.get("session", trace["session"])].append(entry)
    assert set(segments) == set(wanted), f"segments of sessions {sorted(segments)}, expected {sorted(wanted)}"
    for session, entries in wanted.items():
        got = segments[session]
        summary = [(s["start_reason"], s["step_indices"], s["boundary_reason"]) for s in got]
        assert len(got) == len(entries), f"{session}: segments {summary}"
        for segment, entry in zip(got, entries, strict=True):
            if entry.get("start_reason") is not None:
                assert segment["start_reason"] == entry["start_reason"], f"{session}: segments {summary}"
            if entry.get("steps") is not None:
                assert segment["step_indices"] == entry["steps"], f"{session}: segments {summary}"
            if "boundary_reason" in entry:
                assert segment["boundary_reason"] == entry["boundary_reason"], f"{session}: segments {summary}"
            if "trajectory_id_prefix" in entry:
                assert segment["trajectory_id"].startswith(entry["trajectory_id_prefix"])
            for key, value in entry.get("metadata", {}).items():
                assert _matches(segment["metadata"].get(key), value), (key, segment["metadata"])

    # Steps: counts, statuses, listed fields.
    own = sum(1 for t in trace["turns"] if t["engine"] is not None and t["engine_session"] == trace["session"])
    for session, count in expect.get("step_count", {trace["session"]: own}).items():
        assert len(steps[session]) == count, f"{session}: {len(steps[session])} steps, expected {count}"
    listed: dict[tuple[str, int], dict[str, Any]] = {}
    for entry in expect.get("steps", []):
        fields = dict(entry)
        listed[(fields.pop("session", trace["session"]), fields.pop("step_index"))] = fields
    for session, group in steps.items():
        for step in group:
            fields = listed.pop((session, step["step_index"]), {})
            status = fields.get("status", "completed")
            assert step["status"] == status, (session, step["step_index"], step["status"], step.get("error"))
            for key, value in fields.items():
                assert step.get(key) == value, (session, step["step_index"], key, step.get(key), value)
    assert not listed, f"expected steps not found: {sorted(listed)}"

    # Universal: equal arrays; every in-segment step in exactly one segment of its session.
    for session, group in segments.items():
        members = [i for s in group for i in s["step_indices"]]
        in_segment = sorted(s["step_index"] for s in steps[session] if s["in_segment"])
        assert sorted(members) == in_segment, f"{session}: segment members {members} vs in-segment {in_segment}"
        for segment in group:
            n = len(segment["token_ids"])
            assert len(segment["loss_mask"]) == len(segment["logprobs"]) == len(segment["versions"]) == n
            assert segment["num_tokens"] == n and segment["num_steps"] == len(segment["step_indices"])
    for session, group in steps.items():
        if session not in segments:
            assert not any(s["in_segment"] for s in group), f"{session}: in-segment steps but no segment"
    # TITO exactness: only where segments are the concatenated exact ids.
    exact = config.get("trajectory_build_mode", "concat") == "concat" and \
        config.get("on_history_rewrite", "segment") == "segment"
    if exact:
        for session, group in segments.items():
            for segment in group:
                check_segment_invariants(segment, steps[session], backend.prompts)
    elif config.get("trajectory_build_mode", "concat") == "concat":
        # recompute: rebuilt replies are trained on recomputed logprobs, so masks differ from plain
        # concat; but every step's prompt is still a prefix of its segment, its output right after.
        for session, group in segments.items():
            for segment in group:
                ids = segment["token_ids"]
                for step in (s for s in steps[session] if s["step_index"] in segment["step_indices"]):
                    start, out = step["prompt_tokens"], step["output_ids"]
                    assert ids[:start] == backend.prompts[step["rid"]].tolist(), (session, step["step_index"])
                    assert ids[start:start + len(out)] == out and all(segment["loss_mask"][start:start + len(out)])
    elif config.get("trajectory_build_mode") == "last_step":
        # A re-rendered conversation, then the last step's sampled ids (trained, with their logprobs).
        for session, group in segments.items():
            for segment in group:
                last = next(s for s in steps[session] if s["step_index"] == segment["step_indices"][-1])
                out = last["output_ids"]
                assert segment["token_ids"][-len(out):] == out and all(segment["loss_mask"][-len(out):])
                assert segment["logprobs"][-len(out):] == last["output_logprobs"]

    # The engine's prompt for a step (what the model really saw).
    for check in expect.get("prompts", []):
        session = check.get("session", trace["session"])
        step = next(s for s in steps[session] if s["step_index"] == check["step"])
        prompt = tokenizer.decode(backend.prompts[step["rid"]].tolist())
        turn_index = step_turn[(session, check["step"])]
        messages, tools = request_chat(trace["turns"][turn_index]["api"], bodies[turn_index])
        fresh = tokenizer.render(messages, tools=tools or None, add_generation_prompt=True)
        for text in check["contains"]:
            assert text in prompt, f"step {check['step']}: the prompt lacks {text!r}"
            if check.get("absent_from_fresh_render"):
                assert text not in fresh, f"a fresh render keeps {text!r}: the check shows nothing"


def _matches(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and all(_matches(got.get(k), v) for k, v in want.items())
    return bool(got == want)


@pytest.mark.parametrize("name", sorted(CORPUS))
async def test_trace(name: str, tokenizer: ChatTokenizer) -> None:
    trace = CORPUS[name]
    tok = tokenizer_for(trace, tokenizer)
    async with serving(trace, tok) as (http, backend):
        bodies, step_turn = await replay(trace, http, backend)
        finalized = await http.post("/session/finalize", json={"session_id": trace["session"]})
        assert finalized.status_code == 200, finalized.text
        # Finalizing the session retired it, and every child session it routed turns to.
        for session in sorted({turn["engine_session"] for turn in trace["turns"]}):
            live = await http.get(f"/session/{session}")
            assert live.status_code == 404, f"{session} is still live after finalize: {live.text[:300]}"
        read = await http.post("/trajectory/read", json={"session_id": trace["session"], "include_steps": True})
        assert read.status_code == 200, read.text
        check_data(trace, read.json(), backend, bodies, step_turn, tok)


#: Behaviours the corpus must cover, each by at least one trace (its ``covers`` tags).
REQUIRED = {
    "echo.args_key_order", "echo.args_spacing", "echo.content_null", "echo.content_empty_string",
    "echo.reasoning_dropped", "echo.reasoning_content_kept", "echo.inline_think", "qwen3.reasoning_stripping",
    "compaction", "edit.user_message", "claude_code.system_reminder", "boundary.system_changed", "tools.added",
    "tools.removed", "boundary.tito_failure", "tools.parallel_3", "tools.long_output", "unicode.cjk",
    "unicode.emoji", "unicode.combining", "whitespace.trailing_spaces", "whitespace.trailing_newlines",
    "whitespace.tabs", "whitespace.crlf", "finish.length_then_turn", "finish.stop_string_then_turn",
    "long_session.200_steps", "retry.same_turn_id", "retry.identical_messages", "sub_agents.train",
    "sub_agents.log", "mode.last_step", "mode.recompute", "mode.verify", "refused.openai_400",
    "refused.anthropic_400", "anthropic.messages", "stream.openai", "anthropic.stream",
}


def test_corpus_is_complete() -> None:
    """The corpus has its traces, each well-formed, each behaviour tag with at least one trace."""
    assert len(TRACE_FILES) >= 14
    covered = {tag for trace in CORPUS.values() for tag in trace["covers"]}
    assert REQUIRED <= covered, sorted(REQUIRED - covered)
    names = set()
    for stem, trace in CORPUS.items():
        assert set(trace) >= {"name", "description", "covers", "config", "session", "turns", "expect"}, stem
        assert stem.split("_", 1)[1] == trace["name"] and trace["name"] not in names
        names.add(trace["name"])
        assert trace["covers"] and trace["turns"] and trace["expect"]["segments"]
        for turn in trace["turns"]:
            assert turn["api"] in ("openai", "anthropic") and turn["path"].startswith("/")
            assert turn["engine"] is None or isinstance(turn["engine"], str | list)
            assert (turn["engine"] is None) == (turn["expect"]["status"] != 200)
