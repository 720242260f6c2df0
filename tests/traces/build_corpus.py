#!/usr/bin/env python3
"""Write the agent-trace corpus (``tests/traces/*.json``) deterministically.

Run by hand from the repository root after changing a trace::

    python tests/traces/build_corpus.py

The JSON files are the corpus; ``tests/tokenization/test_trace_corpus.py`` replays them.
The format is described in ``tests/traces/README.md``. This script only
*writes* traces: it decides what the engine samples for every call, predicts
the reply the proxy returns (content, reasoning, tool calls with their
deterministic ids from :func:`actorproxy.runtime.output.tool_call_id`) and
writes the later requests with the agent's echo of those replies, exactly as
the agent would send them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from actorproxy.runtime.output import tool_call_id
from actorproxy.tokenization.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parent
TOK = load_tokenizer(None)

# -- what the model writes ----------------------------------------------------------


@dataclass
class Out:
    """One generation: optional ``<think>`` reasoning, text, then Hermes tool calls."""

    reasoning: str | None = None
    content: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: Plain text sampled as these pieces, each tokenized on its own (written to the trace as a list):
    #: for outputs whose canonical tokenization would differ, e.g. combining characters under NFC.
    pieces: list[str] | None = None

    def engine(self) -> str | list[str]:
        """The trace's ``engine`` field."""
        return self.pieces if self.pieces is not None else self.text()

    def ids(self) -> list[int]:
        """The ids the engine samples (before ``<|im_end|>``)."""
        if self.pieces is not None:
            return [i for piece in self.pieces for i in TOK.encode(piece)]
        ids = list(TOK.encode(self.text()))
        assert TOK.decode(ids) == self.text(), f"tokenizing changes {self.text()!r} (NFC?): use pieces"
        return ids

    def text(self) -> str:
        """The exact text the engine samples (the simulated engine appends ``<|im_end|>``)."""
        if self.pieces is not None:
            assert self.reasoning is None and not self.content and not self.calls
            return "".join(self.pieces)
        text = f"<think>\n{self.reasoning}\n</think>\n\n" if self.reasoning is not None else ""
        text += self.content
        for i, (name, args) in enumerate(self.calls):
            if self.content or i:
                text += "\n"
            text += "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            text += "\n</tool_call>"
        return text


@dataclass
class Reply:
    """What the proxy returns for one generation (as predicted here), and how agents echo it."""

    session: str  # the session that runs the step (a sub-agent's child session for its turns)
    step: int
    content: str
    reasoning: str
    calls: list[dict[str, Any]]  # {"id", "name", "arguments": text, "input": object}
    finish: str  # OpenAI finish_reason

    # OpenAI echoes ---------------------------------------------------------------

    def openai(
        self,
        *,
        reasoning: str = "drop",
        content_null: bool = True,
        args: str = "verbatim",
        omit_content: bool = False,
        drop_type: bool = False,
        content_suffix: str = "",
    ) -> dict[str, Any]:
        """The agent's echo of this reply.

        ``reasoning``: ``drop``, ``field`` (``reasoning_content``), ``reasoning`` (the
        ``reasoning`` field vLLM uses), ``inline`` (``<think>`` in the content).
        ``content_null``: a bare tool call echoes ``content: null`` (else ``""``).
        ``args``: ``verbatim``, ``sorted_indent``, ``compact_reversed``, ``ascii``.
        """
        content: Any = self.content + content_suffix
        if reasoning == "inline" and self.reasoning:
            content = f"<think>\n{self.reasoning}\n</think>\n\n{self.content}"
        if not content and self.calls:
            content = None if content_null else ""
        message: dict[str, Any] = {"role": "assistant"}
        if not omit_content:
            message["content"] = content
        if reasoning == "field" and self.reasoning:
            message["reasoning_content"] = self.reasoning
        if reasoning == "reasoning" and self.reasoning:
            message["reasoning"] = self.reasoning
        if self.calls:
            message["tool_calls"] = []
            for call in self.calls:
                text = call["arguments"]
                if args == "sorted_indent":
                    text = json.dumps(call["input"], sort_keys=True, indent=2)
                elif args == "compact_reversed":
                    text = json.dumps(dict(reversed(list(call["input"].items()))), separators=(",", ":"),
                                      ensure_ascii=False)
                elif args == "ascii":
                    text = json.dumps(call["input"])
                entry: dict[str, Any] = {"id": call["id"], "type": "function",
                                         "function": {"name": call["name"], "arguments": text}}
                if drop_type:
                    del entry["type"]
                message["tool_calls"].append(entry)
        return message

    def tool_ids(self) -> list[str]:
        return [c["id"] for c in self.calls]

    # Anthropic echo ---------------------------------------------------------------

    def anthropic(self, *, cache_last: bool = False) -> dict[str, Any]:
        """The assistant message as Claude Code sends it back: the blocks it received."""
        blocks: list[dict[str, Any]] = []
        if self.reasoning:
            signature = "actorproxy-sha256-" + hashlib.sha256(self.reasoning.encode()).hexdigest()
            blocks.append({"type": "thinking", "thinking": self.reasoning, "signature": signature})
        if self.content:
            blocks.append({"type": "text", "text": self.content})
        for call in self.calls:
            blocks.append({"type": "tool_use", "id": call["id"], "name": call["name"], "input": call["input"]})
        if cache_last:
            blocks[-1] = {**blocks[-1], "cache_control": {"type": "ephemeral"}}
        return {"role": "assistant", "content": blocks}


ANTHROPIC_FINISH = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}


class Trace:
    """Builds one trace file, turn by turn, keeping the step counters of every session."""

    def __init__(
        self,
        name: str,
        description: str,
        covers: list[str],
        *,
        session: str,
        config: dict[str, Any] | None = None,
        tokenizer: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.session = session
        self.data: dict[str, Any] = {
            "name": name,
            "description": description,
            "covers": covers,
            "config": config or {},
            **({"tokenizer": tokenizer} if tokenizer else {}),
            "session": session,
            "turns": [],
            "expect": {},
        }
        self.steps: dict[str, int] = {}
        self._bodies: list[dict[str, Any]] = []

    # -- turns ------------------------------------------------------------------------

    def _route(self, api: str, url: bool) -> tuple[str, dict[str, str]]:
        if api == "openai":
            if url:
                return f"/sess/{self.session}/v1/chat/completions", {}
            return "/v1/chat/completions", {"X-Session-Id": self.session}
        if url:
            return f"/sess/{self.session}/v1/messages?beta=true", {}
        return "/v1/messages", {"X-Session-Id": self.session}

    def turn(self, body: dict[str, Any], out: Out, **kw: Any) -> Reply:
        """Add a turn the engine answers with ``out``; returns the reply the proxy gives."""
        reply = self._add(body, out, **kw)
        assert reply is not None
        return reply

    def refused(self, body: dict[str, Any], *, status: int, error: dict[str, Any], **kw: Any) -> None:
        """Add a request the proxy refuses (nothing reaches the engine, nothing is recorded)."""
        self._add(body, None, status=status, expect_error=error, **kw)

    def _add(
        self,
        body: dict[str, Any],
        out: Out | None,
        *,
        api: str = "openai",
        url: bool = False,
        headers: dict[str, str] | None = None,
        step_session: str | None = None,
        extends: int | None = None,
        expect_error: dict[str, Any] | None = None,
        status: int = 200,
        note: str | None = None,
    ) -> Reply | None:
        """Add a turn; ``out`` is what the engine samples (None: the proxy refuses the request).

        ``extends``: the body only lists the messages appended to turn ``extends``'s body
        (its other fields are inherited); the file stays small for long sessions.
        """
        path, route_headers = self._route(api, url)
        full = copy.deepcopy(body)
        if extends is not None:
            base = copy.deepcopy(self._bodies[extends])
            base.update({k: v for k, v in body.items() if k != "messages"})
            base["messages"] = base["messages"] + copy.deepcopy(body["messages"])
            full = base
        self._bodies.append(full)
        turn: dict[str, Any] = {"api": api, "path": path, "headers": {**route_headers, **(headers or {})}}
        if note:
            turn["note"] = note
        if extends is not None:
            turn["body_extends"] = extends
        turn["body"] = copy.deepcopy(body)
        runs_in = step_session or self.session
        turn["engine_session"] = runs_in
        if out is None:
            turn["engine"] = None
            turn["expect"] = {"status": status, "error": expect_error or {}}
            self.data["turns"].append(turn)
            return None
        step = self.steps.get(runs_in, 0)
        self.steps[runs_in] = step + 1
        reply = predict(out, full, runs_in, step)
        turn["engine"] = out.engine()
        expected: dict[str, Any] = {"status": 200, "step_index": step}
        if runs_in != self.session:
            expected["session_id"] = runs_in
        finish = reply.finish if api == "openai" else ANTHROPIC_FINISH[reply.finish]
        if api == "anthropic" and reply.finish == "stop" and _stop_hit(out, full):
            finish = "stop_sequence"
        expected["reply"] = {
            "finish": finish,
            "content": reply.content,
            "reasoning": reply.reasoning,
            "tool_calls": [{"id": c["id"], "name": c["name"], "arguments": c["input"]} for c in reply.calls],
        }
        turn["expect"] = expected
        self.data["turns"].append(turn)
        return reply

    def expect(self, **fields: Any) -> None:
        self.data["expect"].update(fields)

    def write(self, index: int) -> Path:
        path = HERE / f"{index:02d}_{self.name}.json"
        path.write_text(json.dumps(self.data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return path


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop", body.get("stop_sequences"))
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _stop_hit(out: Out, body: dict[str, Any]) -> bool:
    return any(s in out.content for s in _stops(body))


def predict(out: Out, body: dict[str, Any], session: str, step: int) -> Reply:
    """The reply the proxy returns when the engine samples ``out.text()`` for ``body``."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    ids = out.ids()
    finish = "stop"
    content, reasoning, calls = out.content if out.pieces is None else out.text(), out.reasoning or "", out.calls
    if limit is not None and len(ids) + 1 > limit:  # +1: the end-of-turn token
        assert out.reasoning is None and not out.calls and out.pieces is None, "length cuts: plain text only"
        content = TOK.decode(ids[:limit])
        assert content.encode("utf-8").decode("utf-8") == content and "\ufffd" not in content
        finish = "length"
    hits = [(content.find(s), s) for s in _stops(body) if s in content]
    if hits and finish == "stop":
        assert not calls, "stop strings are predicted for text replies only"
        # Text cut by a stop string keeps the whitespace before it (OpenAI's rule); its start is stripped.
        content = content[: min(hits)[0]].lstrip()
    else:
        content = content.strip()
    reply_calls = [
        {"id": tool_call_id(session, step, i), "name": name,
         "arguments": json.dumps(args, ensure_ascii=False), "input": args}
        for i, (name, args) in enumerate(calls)
    ]
    if reply_calls and finish == "stop":
        finish = "tool_calls"
    return Reply(session, step, content, reasoning.strip(), reply_calls, finish)


def tool_results(reply: Reply, results: Iterable[str]) -> list[dict[str, Any]]:
    """OpenAI tool messages answering ``reply``'s calls, in order."""
    results = list(results)
    assert len(results) == len(reply.calls)
    return [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(reply.calls, results, strict=True)]


def seg(start: str | None, steps: list[int] | None, *, boundary: str | None = None, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"start_reason": start, "steps": steps}
    if boundary is not None:
        entry["boundary_reason"] = boundary
    entry.update(extra)
    return entry


def fn_tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


def ant_tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": props, "required": required,
                             "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}


S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741

READ = fn_tool("read_file", "Read a file of the workspace; returns numbered lines.",
               {"path": S, "offset": I, "limit": I}, ["path"])
SHELL = fn_tool("run_shell", "Run a shell command in the workspace and return its output.",
                {"command": S, "timeout": I}, ["command"])
EDIT = fn_tool("edit_file", "Replace one exact occurrence of `old` with `new` in a file.",
               {"path": S, "old": S, "new": S}, ["path", "old", "new"])
SEARCH = fn_tool("search_code", "Search the repository with a regular expression.",
                 {"pattern": S, "glob": S}, ["pattern"])
WEATHER = fn_tool("get_weather", "Weather forecast of a city.", {"city": S, "days": I}, ["city"])
HOTELS = fn_tool("search_hotels", "Hotels of a city with their nightly prices in EUR.",
                 {"city": S, "checkin": S, "nights": I}, ["city", "checkin"])
BROWSER = fn_tool("mcp__browser__open", "Open a URL in the headless browser and return the page text.",
                  {"url": S}, ["url"])

CODING_SYSTEM = ("You are a coding agent working in the repository at /repo. Use the tools to inspect, "
                 "run and change code. Keep answers short.")

CC_SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks. "
                             "Use the instructions below and the tools available to you to assist the user.\n\n"
                             "# Tone and style\nBe concise, direct, and to the point.",
     "cache_control": {"type": "ephemeral"}},
]
CC_TOOLS = [
    ant_tool("Task", "Launch a new agent to handle complex, multi-step tasks autonomously.",
             {"description": S, "prompt": S, "subagent_type": S}, ["description", "prompt", "subagent_type"]),
    ant_tool("Bash", "Executes a given bash command in a persistent shell session.",
             {"command": S, "description": S, "timeout": {"type": "number"}}, ["command"]),
    ant_tool("Read", "Reads a file from the local filesystem.",
             {"file_path": S, "offset": {"type": "number"}, "limit": {"type": "number"}}, ["file_path"]),
    ant_tool("Grep", "A powerful search tool built on ripgrep.",
             {"pattern": S, "path": S, "output_mode": S}, ["pattern"]),
    ant_tool("Edit", "Performs exact string replacements in files.",
             {"file_path": S, "old_string": S, "new_string": S}, ["file_path", "old_string", "new_string"]),
]
CC_HEADERS = {"anthropic-version": "2023-06-01",
              "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
              "x-app": "cli", "User-Agent": "claude-cli/1.0.98 (external, cli)"}


def cc_body(messages: list[dict[str, Any]], *, system: Any = None, tools: Any = None,
            **extra: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-20250514", "max_tokens": 32000, "system": system or CC_SYSTEM,
            "tools": tools if tools is not None else CC_TOOLS, "messages": messages,
            "metadata": {"user_id": "user_4f1c_account__session_7d3a"}, "stream": True,
            # Thinking on, as Claude Code sends it: only then does a reply carry thinking blocks.
            "thinking": {"type": "enabled", "budget_tokens": 31999}, **extra}


def tool_result(reply: Reply, texts: list[str | list[dict[str, Any]]], *, error: bool = False) -> list[dict[str, Any]]:
    return [{"type": "tool_result", "tool_use_id": c["id"], "content": t, **({"is_error": True} if error else {})}
            for c, t in zip(reply.calls, texts, strict=True)]


def oa(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "qwen3-8b", "messages": messages}
    if tools:
        body["tools"] = tools
        body["tool_choice"] = "auto"
    body.update(extra)
    return body


# -- the traces ------------------------------------------------------------------------


def t_echo_reserialised() -> Trace:
    t = Trace(
        "echo_reserialised",
        "A LiteLLM-style coding agent that re-serialises every assistant turn it echoes: tool arguments "
        "with other key order, indentation and \\u escapes, content null vs \"\", reasoning_content dropped, "
        "the tool call's type missing, stray whitespace around content. One refused request (n=2) in the middle "
        "changes nothing. Everything continues one segment.",
        ["echo.args_key_order", "echo.args_spacing", "echo.args_ascii_escapes", "echo.content_null",
         "echo.content_empty_string", "echo.reasoning_dropped", "echo.content_whitespace", "echo.no_type",
         "refused.openai_400", "one_segment"],
        session="trace-echo-reserialised",
    )
    tools = [READ, EDIT, SHELL]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": CODING_SYSTEM},
        {"role": "user", "content": "The CLI crashes with KeyError: 'timeout' when config.toml has no [net] "
                                    "section. Fix it."},
    ]
    r0 = t.turn(oa(msgs, tools, temperature=0.7), Out(
        reasoning="I should look at how the config is loaded first.",
        calls=[("read_file", {"path": "src/cli/config.py", "limit": 200})]))
    msgs += [r0.openai(content_null=False, args="sorted_indent"),
             *tool_results(r0, ['1\timport tomllib\n2\t\n3\tdef load(path):\n'
                                '4\t    cfg = tomllib.load(open(path, "rb"))\n'
                                '5\t    timeout = cfg["net"]["timeout"]\n6\t    return cfg, timeout\n'])]
    r1 = t.turn(oa(msgs, tools, temperature=0.7), Out(
        reasoning="Line 5 indexes [net] directly. Use .get with a default of 30 seconds.",
        calls=[("edit_file", {"path": "src/cli/config.py",
                              "old": 'timeout = cfg["net"]["timeout"]',
                              "new": 'timeout = cfg.get("net", {}).get("timeout", 30)  # défaut : 30 s'})]))
    msgs += [r1.openai(content_null=True, args="ascii", drop_type=True),
             *tool_results(r1, ["Edited src/cli/config.py: 1 replacement."])]
    r2 = t.turn(oa(msgs, tools, temperature=0.7), Out(
        content="Now I run the config tests.",
        calls=[("run_shell", {"command": "python -m pytest -q tests/test_config.py", "timeout": 120})]))
    msgs += [r2.openai(args="compact_reversed", content_suffix="\n "),
             *tool_results(r2, ["...\n3 passed in 0.12s\n"])]
    t.refused(oa(msgs, tools, temperature=0.7, n=2), status=400,
              error={"type": "invalid_request_error", "param": "n", "code": "invalid_request"},
              note="the agent asks for two choices: refused, nothing recorded")
    t.turn(oa(msgs, tools, temperature=0.7), Out(
        reasoning="Tests pass; summarise.",
        content="Fixed: `load` now falls back to a 30 s timeout when the [net] section is missing. "
                "The 3 config tests pass."))
    t.expect(segments=[seg("session_start", [0, 1, 2, 3], boundary="finalize")])
    return t


def t_echo_reasoning_kept() -> Trace:
    t = Trace(
        "echo_reasoning_kept",
        "An agent on a per-session URL that keeps the reasoning when it echoes: as reasoning_content "
        "(the openai SDK's model_dump(exclude_none=True), which also drops the null content key), as inline "
        "<think>...</think> in the content, and as vLLM's `reasoning` field. Two turns are streamed. One segment.",
        ["echo.reasoning_content_kept", "echo.inline_think", "echo.reasoning_field", "echo.content_key_missing",
         "stream.openai", "url.per_session", "one_segment"],
        session="trace-echo-reasoning",
    )
    tools = [WEATHER, HOTELS]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel assistant. Use the tools for facts."},
        {"role": "user", "content": "Is it worth going to Annecy this weekend? Check weather and a hotel."},
    ]
    r0 = t.turn(oa(msgs, tools), Out(reasoning="First the forecast for Annecy, two days.",
                                     calls=[("get_weather", {"city": "Annecy", "days": 2})]), url=True)
    msgs += [r0.openai(reasoning="field", omit_content=True),
             *tool_results(r0, ['{"city": "Annecy", "forecast": ["sunny 24°C", "storms 19°C"]}'])]
    r1 = t.turn(oa(msgs, tools, stream=True), Out(
        reasoning="Saturday is good, Sunday stormy. Now a hotel for one night.",
        calls=[("search_hotels", {"city": "Annecy", "checkin": "2025-06-14", "nights": 1})]), url=True)
    msgs += [r1.openai(reasoning="inline", content_null=False),
             *tool_results(r1, ['[{"name": "Hôtel du Lac", "price": 142}, {"name": "Les Trésoms", "price": 265}]'])]
    r2 = t.turn(oa(msgs, tools), Out(
        reasoning="Recommend Saturday only, the cheaper hotel.",
        content="Yes for Saturday: sunny, 24 °C, and Hôtel du Lac is €142. Sunday looks stormy."), url=True)
    msgs += [r2.openai(reasoning="reasoning"),
             {"role": "user", "content": "And if I stay two nights?"}]
    r3 = t.turn(oa(msgs, tools, stream=True, stream_options={"include_usage": True}), Out(
        reasoning="Two nights at 142 is 284.",
        content="Two nights at Hôtel du Lac come to €284; plan indoor things for Sunday."), url=True)
    msgs += [r3.openai(reasoning="inline"), {"role": "user", "content": "Thanks!"}]
    t.turn(oa(msgs, tools), Out(content="Have a great trip!"), url=True)
    t.expect(segments=[seg("session_start", [0, 1, 2, 3, 4], boundary="finalize")])
    return t


def t_qwen3_reasoning() -> Trace:
    t = Trace(
        "qwen3_reasoning_multiturn",
        "A plain multi-turn chat where every reply reasons. The Qwen3 template drops <think> blocks from "
        "assistant turns before the last user message, so a re-render would differ from what the model saw; "
        "TITO keeps the sampled reasoning tokens. One segment; the last step's prompt (as the engine got it) "
        "still holds every earlier reasoning block, which a fresh render of the same request does not.",
        ["qwen3.reasoning_stripping", "tito.prompt_keeps_sampled_reasoning", "stream.openai", "one_segment"],
        session="trace-qwen3-reasoning",
    )
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a patient math tutor."},
                                  {"role": "user", "content": "What is 17 × 23?"}]
    thoughts = ["17 × 23 = 17 × 20 + 17 × 3 = 340 + 51 = 391.",
                "391 = 17 × 23, both prime, so its divisors are 1, 17, 23, 391.",
                "Sum of divisors: 1 + 17 + 23 + 391 = 432."]
    answers = ["17 × 23 = 391.", "391 has four divisors: 1, 17, 23 and 391.", "They add up to 432."]
    questions = ["Which numbers divide 391?", "What is the sum of those divisors?", "Is 432 a perfect number?"]
    for i in range(3):
        r = t.turn(oa(msgs, stream=(i % 2 == 1)), Out(reasoning=thoughts[i], content=answers[i]))
        msgs += [r.openai(), {"role": "user", "content": questions[i]}]
    t.turn(oa(msgs), Out(reasoning="A perfect number equals the sum of its proper divisors: 432 - 391 = 41 ≠ 391.",
                         content="No: its proper divisors sum to 41, not 391."))
    t.expect(
        segments=[seg("session_start", [0, 1, 2, 3], boundary="finalize")],
        prompts=[{"step": 3, "contains": [f"<think>\n{x}\n</think>" for x in thoughts],
                  "absent_from_fresh_render": True}],
    )
    return t


def t_compaction() -> Trace:
    t = Trace(
        "compaction_summary",
        "An opencode-style agent runs a tool loop, asks the model to summarise the conversation (that call "
        "still extends the history), then continues from [system, summary] only: the earlier turns are gone, "
        "so the next call opens a history_rewrite segment, which the loop then continues.",
        ["compaction", "boundary.history_rewrite", "summary_call_continues"],
        session="trace-compaction",
    )
    tools = [READ, SHELL, EDIT]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": CODING_SYSTEM},
        {"role": "user", "content": "Add a --json flag to `tool stats` that prints the stats as JSON."},
    ]
    r0 = t.turn(oa(msgs, tools), Out(reasoning="Find the stats command.",
                                     calls=[("run_shell", {"command": "grep -rn 'def stats' src/"})]))
    msgs += [r0.openai(), *tool_results(r0, ["src/tool/commands.py:88:def stats(args):"])]
    r1 = t.turn(oa(msgs, tools), Out(calls=[("read_file", {"path": "src/tool/commands.py", "offset": 80,
                                                           "limit": 30})]))
    msgs += [r1.openai(), *tool_results(r1, ["88\tdef stats(args):\n89\t    s = compute(args.path)\n"
                                             "90\t    for k, v in s.items():\n91\t        print(f'{k}: {v}')\n"])]
    r2 = t.turn(oa(msgs, tools), Out(
        reasoning="Add the flag and a json.dumps branch.",
        calls=[("edit_file", {"path": "src/tool/commands.py", "old": "    for k, v in s.items():",
                              "new": "    if args.json:\n        print(json.dumps(s))\n        return\n"
                                     "    for k, v in s.items():"})]))
    msgs += [r2.openai(), *tool_results(r2, ["Edited src/tool/commands.py."])]
    r3 = t.turn(oa(msgs, tools), Out(content="Now register the flag in the parser.",
                                     calls=[("run_shell", {"command": "grep -n 'stats' src/tool/cli.py"})]))
    msgs += [r3.openai(), *tool_results(r3, ["41:    p = sub.add_parser('stats')"])]
    summary_request = msgs + [{"role": "user", "content": "Provide a detailed summary of our conversation above "
                                                          "so that a new session can continue the work."}]
    summary = ("Task: add --json to `tool stats`. Done: stats() in src/tool/commands.py prints json.dumps(s) when "
               "args.json is set. Left: add the flag in src/tool/cli.py line 41 and run the tests.")
    t.turn(oa(summary_request, tools), Out(reasoning="Summarise state and next steps.", content=summary),
           note="the compaction call: still an append to the history")
    msgs = [
        {"role": "system", "content": CODING_SYSTEM},
        {"role": "user", "content": "This session is being continued from a previous conversation that ran out of "
                                    "context. The conversation is summarized below:\n" + summary +
                                    "\nPlease continue the conversation from where we left it off."},
    ]
    r5 = t.turn(oa(msgs, tools), Out(
        calls=[("edit_file", {"path": "src/tool/cli.py", "old": "    p = sub.add_parser('stats')",
                              "new": "    p = sub.add_parser('stats')\n"
                                     "    p.add_argument('--json', action='store_true')"})]),
        note="after compaction: history_rewrite")
    msgs += [r5.openai(), *tool_results(r5, ["Edited src/tool/cli.py."])]
    r6 = t.turn(oa(msgs, tools), Out(calls=[("run_shell", {"command": "python -m pytest -q", "timeout": 300})]))
    msgs += [r6.openai(), *tool_results(r6, ["12 passed in 1.02s"])]
    t.turn(oa(msgs, tools), Out(content="Done: `tool stats --json` prints the stats as JSON; 12 tests pass."))
    t.expect(segments=[seg("session_start", [0, 1, 2, 3, 4], boundary="history_rewrite"),
                       seg("history_rewrite", [5, 6, 7], boundary="finalize")])
    return t


def t_mid_history_edit() -> Trace:
    t = Trace(
        "mid_history_edit",
        "A chat UI where the human edits an earlier message (fixing a typo) and the client regenerates from "
        "there: the edited user turn no longer matches, so history_rewrite. Later the harness truncates an old "
        "tool output to save context: another history_rewrite.",
        ["boundary.history_rewrite", "edit.user_message", "edit.tool_output_truncated"],
        session="trace-mid-history-edit",
    )
    tools = [SHELL]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant with a shell."},
        {"role": "user", "content": "How big is the repo?"},
    ]
    r0 = t.turn(oa(msgs, tools), Out(calls=[("run_shell", {"command": "du -sh ."})]))
    msgs += [r0.openai(), *tool_results(r0, ["48M\t."])]
    r1 = t.turn(oa(msgs, tools), Out(content="The repository takes 48 MB."))
    msgs += [r1.openai(), {"role": "user", "content": "How many pyhton files are there?"}]
    r2 = t.turn(oa(msgs, tools), Out(reasoning="Count *.py files.",
                                     calls=[("run_shell", {"command": "find . -name '*.py' | wc -l"})]))
    msgs += [r2.openai(), *tool_results(r2, ["312"])]
    t.turn(oa(msgs, tools), Out(content="There are 312 Python files."))
    # The human fixes the typo in message 5 and regenerates from it.
    edited = msgs[:5] + [{"role": "user", "content": "How many python files are there, tests excluded?"}]
    r4 = t.turn(oa(edited, tools), Out(
        calls=[("run_shell", {"command": "find . -name '*.py' -not -path './tests/*' | wc -l"})]),
        note="user message 5 edited: history_rewrite")
    edited += [r4.openai(), *tool_results(r4, ["241\n" + "".join(f"./src/m{i}.py\n" for i in range(40))])]
    r5 = t.turn(oa(edited, tools), Out(content="241 Python files outside tests/."))
    edited += [r5.openai(), {"role": "user", "content": "And lines of code?"}]
    r6 = t.turn(oa(edited, tools), Out(calls=[("run_shell", {"command": "cat $(git ls-files '*.py') | wc -l"})]))
    # The harness shortens the long tool output of r4 before sending the next request.
    truncated = copy.deepcopy(edited)
    truncated[7] = {**truncated[7], "content": "241\n[... 40 lines truncated ...]"}
    truncated += [r6.openai(), *tool_results(r6, ["58210"])]
    t.turn(oa(truncated, tools), Out(content="About 58k lines of Python."),
           note="an old tool output was truncated by the harness: history_rewrite")
    t.expect(segments=[seg("session_start", [0, 1, 2, 3], boundary="history_rewrite"),
                       seg("history_rewrite", [4, 5, 6], boundary="history_rewrite"),
                       seg("history_rewrite", [7], boundary="finalize")])
    return t


def t_claude_code_reminder() -> Trace:
    s = "trace-cc-reminder"
    t = Trace(
        "claude_code_system_reminder",
        "Claude Code over /sess/<id>/v1/messages?beta=true (streamed, thinking echoed with signatures, "
        "tool_use/tool_result blocks, cache_control, reminders appended to the newest user turn). Then Claude "
        "Code injects a <system-reminder> into the FIRST user message: history_rewrite. An assistant prefill "
        "request in between is refused with an Anthropic-shaped 400.",
        ["anthropic.messages", "anthropic.stream", "claude_code.system_reminder", "boundary.history_rewrite",
         "echo.thinking_signature", "refused.anthropic_400", "url.per_session"],
        session=s,
    )
    h = {**CC_HEADERS, "X-Claude-Code-Session-Id": "5f0c2a9e-cc-session"}
    reminder0 = {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the "
                                         "following context:\n# claudeMd\nRun tests with `pytest -q`.\n"
                                         "</system-reminder>"}
    first_user = {"role": "user", "content": [reminder0, {"type": "text", "text": "Run the tests and fix what "
                                                                                   "fails.",
                                                          "cache_control": {"type": "ephemeral"}}]}
    msgs: list[dict[str, Any]] = [first_user]
    kw = {"api": "anthropic", "url": True, "headers": h}
    r0 = t.turn(cc_body(msgs), Out(reasoning="Run the suite to see what fails.",
                                   calls=[("Bash", {"command": "pytest -q", "description": "Run the test suite"})]),
                **kw)
    msgs += [r0.anthropic(), {"role": "user", "content": tool_result(r0, [
        "F..\n=== FAILURES ===\ntest_roundtrip: assert b'a\\r\\n' == b'a\\n'\n1 failed, 2 passed"], error=True)}]
    r1 = t.turn(cc_body(msgs), Out(reasoning="Line endings: look at io.py.",
                                   calls=[("Read", {"file_path": "/repo/src/io.py"})]), **kw)
    msgs += [r1.anthropic(), {"role": "user", "content": [
        *tool_result(r1, [[{"type": "text", "text": "     1\tdef write(path, text):\n     2\t    "
                                                    "open(path, 'w').write(text)\n"}]]),
        {"type": "text", "text": "<system-reminder>\nThe TodoWrite tool hasn't been used recently.\n"
                                 "</system-reminder>"}]}]
    r2 = t.turn(cc_body(msgs), Out(
        reasoning="Open with newline='' so Windows line endings are not translated.",
        content="The file is opened in text mode; I'll keep line endings as written.",
        calls=[("Edit", {"file_path": "/repo/src/io.py", "old_string": "open(path, 'w')",
                         "new_string": "open(path, 'w', newline='')"})]), **kw)
    prefill = msgs + [r2.anthropic(), {"role": "user", "content": tool_result(r2, ["ok"])},
                      {"role": "assistant", "content": "Now"}]
    t.refused(cc_body(prefill), status=400, error={"type": "invalid_request_error"},
              note="assistant prefill: refused", **kw)
    injected: dict[str, Any] = copy.deepcopy(first_user)
    injected["content"].insert(1, {"type": "text", "text": "<system-reminder>\nNote: /repo/src/io.py was modified "
                                                           "by the user or by a linter.\n</system-reminder>"})
    msgs = [injected] + msgs[1:] + [r2.anthropic(cache_last=True),
                                    {"role": "user", "content": tool_result(r2, ["The file /repo/src/io.py has been "
                                                                                 "updated."])}]
    r3 = t.turn(cc_body(msgs), Out(calls=[("Bash", {"command": "pytest -q", "description": "Re-run the tests"})]),
                note="reminder injected into the first user turn: history_rewrite", **kw)
    msgs += [r3.anthropic(), {"role": "user", "content": tool_result(r3, ["...\n3 passed in 0.05s"])}]
    r4 = t.turn(cc_body(msgs), Out(reasoning="All green.",
                                   content="Fixed: `write` now opens files with `newline=''`, so `\\r\\n` is kept. "
                                           "All 3 tests pass."), **kw)
    msgs += [r4.anthropic(), {"role": "user", "content": [{"type": "text", "text": "commit it"}]}]
    r5 = t.turn(cc_body(msgs), Out(calls=[("Bash", {"command": "git commit -am 'io: keep line endings'",
                                                    "description": "Commit the fix"})]), **kw)
    msgs += [r5.anthropic(), {"role": "user", "content": tool_result(r5, ["[main 1a2b3c4] io: keep line endings"])}]
    t.turn(cc_body(msgs), Out(content="Committed as 1a2b3c4."), **kw)
    t.expect(segments=[seg("session_start", [0, 1, 2], boundary="history_rewrite"),
                       seg("history_rewrite", [3, 4, 5, 6], boundary="finalize")])
    return t


def t_system_changed() -> Trace:
    t = Trace(
        "system_prompt_changed",
        "A shell agent that writes its working directory into the system prompt (sent as the `developer` role). "
        "After a `cd` it updates the system prompt and keeps the rest of the history, first user message "
        "identical: system_changed.",
        ["boundary.system_changed", "role.developer"],
        session="trace-system-changed",
    )
    tools = [SHELL, READ]

    def system(cwd: str) -> dict[str, Any]:
        return {"role": "developer", "content": f"You are a shell agent.\nWorking directory: {cwd}\n"
                                                "Date: 2025-06-12"}

    rest: list[dict[str, Any]] = [{"role": "user", "content": "List the packages and show the README of pkg."}]
    r0 = t.turn(oa([system("/repo")] + rest, tools), Out(calls=[("run_shell", {"command": "ls"})]))
    rest += [r0.openai(), *tool_results(r0, ["README.md\npkg\nsetup.cfg"])]
    r1 = t.turn(oa([system("/repo")] + rest, tools), Out(calls=[("run_shell", {"command": "cd pkg"})]))
    rest += [r1.openai(), *tool_results(r1, [""])]
    r2 = t.turn(oa([system("/repo/pkg")] + rest, tools), Out(calls=[("read_file", {"path": "README.md"})]),
                note="the system prompt now names the new directory: system_changed")
    rest += [r2.openai(), *tool_results(r2, ["# pkg\nA tiny package."])]
    r3 = t.turn(oa([system("/repo/pkg")] + rest, tools), Out(content="pkg's README: “A tiny package.”"))
    rest += [r3.openai(), {"role": "user", "content": "ok"}]
    t.turn(oa([system("/repo/pkg")] + rest, tools), Out(content="Anything else?"))
    t.expect(segments=[seg("session_start", [0, 1], boundary="system_changed"),
                       seg("system_changed", [2, 3, 4], boundary="finalize")])
    return t


def t_tool_schema() -> Trace:
    t = Trace(
        "tool_schema_changes",
        "An agent whose MCP browser server connects mid-session (a tool is added) and later disconnects (the "
        "tool is removed): tool_schema_change twice.",
        ["boundary.tool_schema_change", "tools.added", "tools.removed"],
        session="trace-tool-schema",
    )
    base = [READ, SHELL]
    more = [READ, SHELL, BROWSER]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": CODING_SYSTEM},
        {"role": "user", "content": "Check whether our docs page matches the README intro."},
    ]
    r0 = t.turn(oa(msgs, base), Out(calls=[("read_file", {"path": "README.md", "limit": 20})]))
    msgs += [r0.openai(), *tool_results(r0, ["# tool\nFast stats for big files."])]
    r1 = t.turn(oa(msgs, base), Out(content="I need a browser to open the docs page.",
                                    calls=[("run_shell", {"command": "cat .mcp.json"})]))
    msgs += [r1.openai(), *tool_results(r1, ['{"servers": {"browser": {"command": "mcp-browser"}}}'])]
    r2 = t.turn(oa(msgs, more), Out(calls=[("mcp__browser__open", {"url": "https://docs.example.org/tool/"})]),
                note="MCP browser connected: a tool was added")
    msgs += [r2.openai(), *tool_results(r2, ["Tool — fast statistics for big files."])]
    r3 = t.turn(oa(msgs, more), Out(content="The docs say “fast statistics for big files”; the README says “Fast "
                                            "stats for big files”. Same meaning, different wording."))
    msgs += [r3.openai(), {"role": "user", "content": "Make the README match the docs."}]
    t.turn(oa(msgs, base), Out(calls=[("run_shell", {"command": "sed -i 's/Fast stats/Fast statistics/' README.md"})]),
           note="MCP browser disconnected: a tool was removed")
    t.expect(segments=[seg("session_start", [0, 1], boundary="tool_schema_change"),
                       seg("tool_schema_change", [2, 3], boundary="tool_schema_change"),
                       seg("tool_schema_change", [4], boundary="finalize")])
    return t


STRICT_TOOL_CHECK = (
    "{%- if loop.first or (loop.previtem.role != 'tool' and not (loop.previtem.role == 'assistant' "
    "and loop.previtem.tool_calls)) -%}"
    "{{- raise_exception('a tool result must follow an assistant turn with tool calls') -}}"
    "{%- endif -%}"
)


def t_tito_failure() -> Trace:
    t = Trace(
        "tito_failure_strict_template",
        "A chat template that validates tool-call pairing (several real templates check message order and "
        "raise): a tool result must follow an assistant turn with tool calls. A full render of the agent's "
        "request is fine, but the fragment is rendered after a stand-in assistant turn WITHOUT tool calls, so "
        "the template raises on every tool-result continuation: tito_failure, with the step flag "
        "concat_incremental_tokenization_failed. A plain user turn after it continues normally. "
        "(The built-in qwen3 template never raises, so this uses a patched copy of it.)",
        ["boundary.tito_failure", "step.concat_incremental_tokenization_failed", "tokenizer.template_patch"],
        session="trace-tito-failure",
        tokenizer={"template_patch": {"after": "{%- elif message.role == 'tool' -%}", "insert": STRICT_TOOL_CHECK}},
    )
    tools = [SHELL]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": "What's the disk usage of /var/log?"},
    ]
    r0 = t.turn(oa(msgs, tools), Out(calls=[("run_shell", {"command": "du -sh /var/log"})]))
    msgs += [r0.openai(), *tool_results(r0, ["1.2G\t/var/log"])]
    r1 = t.turn(oa(msgs, tools), Out(content="Let me see which files are biggest.",
                                     calls=[("run_shell", {"command": "du -ah /var/log | sort -h | tail -3"})]),
                note="fragment [tool] fails to render: tito_failure")
    msgs += [r1.openai(), *tool_results(r1, ["200M\t/var/log/syslog.1\n400M\t/var/log/journal\n1.2G\t/var/log"])]
    r2 = t.turn(oa(msgs, tools), Out(content="/var/log uses 1.2 GB; the journal (400 MB) is the biggest part."),
                note="again a tool-result continuation: tito_failure")
    msgs += [r2.openai(), {"role": "user", "content": "How do I shrink the journal?"}]
    t.turn(oa(msgs, tools), Out(content="Run `journalctl --vacuum-size=100M`."),
           note="a user turn renders as a fragment: continues the tito_failure segment")
    t.expect(
        segments=[seg("session_start", [0], boundary="tito_failure"),
                  seg("tito_failure", [1], boundary="tito_failure"),
                  seg("tito_failure", [2, 3], boundary="finalize")],
        steps=[{"step_index": 0, "concat_incremental_tokenization_failed": False},
               {"step_index": 1, "concat_incremental_tokenization_failed": True, "boundary_reason": "tito_failure"},
               {"step_index": 2, "concat_incremental_tokenization_failed": True, "boundary_reason": "tito_failure"},
               {"step_index": 3, "concat_incremental_tokenization_failed": False, "boundary_reason": None}],
    )
    return t


def t_parallel_calls() -> Trace:
    t = Trace(
        "parallel_tool_calls",
        "A travel agent that fans out: three parallel tool calls in one reply, three tool results in one "
        "request, several times in a 7-step loop; some replies streamed (tool-call deltas by index). One segment.",
        ["tools.parallel_3", "tools.results_3", "stream.openai_tool_calls", "one_segment"],
        session="trace-parallel-calls",
    )
    tools = [WEATHER, HOTELS, SEARCH]
    cities = ["Paris", "Lyon", "Nice"]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You plan weekend trips. Call tools in parallel when you can."},
        {"role": "user", "content": "Compare weather and hotel prices in Paris, Lyon and Nice for June 14–15."},
    ]
    r = t.turn(oa(msgs, tools, parallel_tool_calls=True), Out(
        reasoning="Weather for all three cities at once.",
        calls=[("get_weather", {"city": c, "days": 2}) for c in cities]))
    msgs += [r.openai(), *tool_results(r, [f'{{"city": "{c}", "forecast": ["{f}"]}}'
                                           for c, f in zip(cities, ["rain 17°C", "sun 26°C", "sun 28°C"],
                                                           strict=True)])]
    r = t.turn(oa(msgs, tools, parallel_tool_calls=True, stream=True), Out(
        reasoning="Now hotels, again in parallel.",
        calls=[("search_hotels", {"city": c, "checkin": "2025-06-14", "nights": 1}) for c in cities]))
    msgs += [r.openai(), *tool_results(r, [f'[{{"name": "H{i}", "price": {p}}}]'
                                           for i, p in enumerate([189, 121, 240])])]
    r = t.turn(oa(msgs, tools, parallel_tool_calls=True), Out(
        content="Lyon looks best value. Let me check events there.",
        calls=[("search_code", {"pattern": "events Lyon June 14"})]))
    msgs += [r.openai(), *tool_results(r, ["Fête de la musique preview, Nuits de Fourvière."])]
    r = t.turn(oa(msgs, tools, parallel_tool_calls=True, stream=True), Out(
        calls=[("get_weather", {"city": "Lyon", "days": 1}),
               ("search_hotels", {"city": "Lyon", "checkin": "2025-06-14", "nights": 2}),
               ("search_code", {"pattern": "Nuits de Fourvière tickets"})]))
    msgs += [r.openai(content_null=False), *tool_results(r, ['{"forecast": ["sun 27°C"]}',
                                                             '[{"name": "H1", "price": 230}]',
                                                             "Tickets from €35."])]
    r = t.turn(oa(msgs, tools, parallel_tool_calls=True), Out(
        content="Lyon: sunny, €230 for two nights at H1, Nuits de Fourvière from €35."))
    msgs += [r.openai(), {"role": "user", "content": "Check Nice and Paris for the weekend after, too."}]
    r = t.turn(oa(msgs, tools, parallel_tool_calls=True), Out(
        calls=[("get_weather", {"city": "Nice", "days": 2}), ("get_weather", {"city": "Paris", "days": 2}),
               ("search_hotels", {"city": "Nice", "checkin": "2025-06-21", "nights": 2})]))
    msgs += [r.openai(args="sorted_indent"), *tool_results(r, ['{"forecast": ["sun"]}', '{"forecast": ["sun"]}',
                                                               '[{"name": "H2", "price": 410}]'])]
    t.turn(oa(msgs, tools, parallel_tool_calls=True), Out(
        content="The weekend after is sunny in both; Nice is €410 for two nights."))
    t.expect(segments=[seg("session_start", [0, 1, 2, 3, 4, 5, 6], boundary="finalize")])
    return t


def _python_file(handlers: int) -> str:
    """A numbered source listing, as a read_file tool shows it."""
    body = [
        "def handle_{n}(request, *, retries=3, timeout=0.9):",
        '    """Validate the request, call the backend and log what happened."""',
        "    payload = request.get_json(silent=True) or {{}}",
        "    if not payload.get('item_id'):",
        "        raise BadRequest('item_id is required for handler {n}')",
        "    for attempt in range(retries):",
        "        try:",
        "            return backend.fetch(payload['item_id'], timeout=timeout)",
        "        except TimeoutError:",
        "            log.warning('handler {n}: attempt %d timed out', attempt)",
        "    raise ServiceUnavailable('backend did not answer')",
        "",
    ]
    lines = [line.format(n=n) for n in range(handlers) for line in body]
    return "\n".join(f"{i:>6}\t{line}" for i, line in enumerate(lines, start=1))


def _log(lines: int) -> str:
    levels = ["INFO", "INFO", "WARN", "INFO", "ERROR"]
    words = ["request finished", "request finished", "backend slow, retrying", "cache refreshed",
             "backend did not answer"]
    return "\n".join(
        f"2025-06-12 10:{i // 60 % 60:02d}:{i % 60:02d} {levels[i % 5]:5} worker-{i % 8} "
        f"{words[i % 5]} for /api/items/{i % 97} after {i * 13 % 900} ms"
        for i in range(lines)
    )


def t_long_outputs() -> Trace:
    t = Trace(
        "long_tool_outputs",
        "Tool outputs of 20-40 kB (a whole source file, a long log, a long grep) in a 4-step loop; later "
        "requests are written as `body_extends` to keep the file small. One segment.",
        ["tools.long_output", "body_extends", "one_segment"],
        session="trace-long-outputs",
    )
    tools = [READ, SHELL, SEARCH]
    source = _python_file(40)
    log = _log(280)
    grep = "\n".join(f"src/handlers/h{i % 40}.py:{i * 3 + 1}:def handle(request, *, retries=3, timeout=0.9):"
                      for i in range(300))
    assert 20_000 <= len(source.encode()) <= 40_000 and 20_000 <= len(log.encode()) <= 40_000
    assert 20_000 <= len(grep.encode()) <= 40_000
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": CODING_SYSTEM},
        {"role": "user", "content": "Requests time out under load. Look at the handlers and the worker log."},
    ]
    r0 = t.turn(oa(msgs, tools), Out(reasoning="Read the handlers file.",
                                     calls=[("read_file", {"path": "src/handlers/main.py"})]))
    r1 = t.turn({"messages": [r0.openai(), *tool_results(r0, [source])]}, Out(
        reasoning="Many handlers with retries=3. Check the log.",
        calls=[("run_shell", {"command": "tail -n 280 /var/log/worker.log"})]), extends=0)
    r2 = t.turn({"messages": [r1.openai(), *tool_results(r1, [log])]}, Out(
        reasoning="ERROR lines every fifth request. Where is retries set?",
        calls=[("search_code", {"pattern": "retries=3", "glob": "src/**/*.py"})]), extends=1)
    t.turn({"messages": [r2.openai(), *tool_results(r2, [grep])]}, Out(
        content="retries=3 is hard-coded in 300 handlers; with 0.9 s per attempt a request can take 2.7 s "
                "before it fails. Make both a setting and lower the per-attempt timeout."), extends=2)
    t.expect(segments=[seg("session_start", [0, 1, 2, 3], boundary="finalize")])
    return t


def t_unicode() -> Trace:
    t = Trace(
        "unicode_whitespace",
        "Replies and messages where BPE could merge across a fragment boundary or where bytes are unusual: "
        "replies ending in spaces, in newlines, in an emoji, with no final newline; CJK, emoji ZWJ sequences, "
        "flags, skin tones, combining characters, tabs, \\r\\n, trailing whitespace in tool output; a reply cut by "
        "max_tokens (finish length) followed by another turn; a reply ended by an OpenAI `stop` string "
        "followed by another turn. Some turns streamed. One segment.",
        ["unicode.cjk", "unicode.emoji", "unicode.combining", "whitespace.trailing_spaces",
         "whitespace.trailing_newlines", "whitespace.tabs", "whitespace.crlf", "finish.length_then_turn",
         "finish.stop_string_then_turn", "stream.openai", "one_segment"],
        session="trace-unicode",
    )
    tools = [SHELL]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a terminal assistant.\tUse tabs\tfreely.\r\nLines may end in CRLF.\r\n"},
        {"role": "user", "content": "Print this as a table:\tname\tqty\r\napple\t3\r\npear\t10\r\n"},
    ]
    r = t.turn(oa(msgs, tools), Out(content="name\tqty\napple\t3\npear\t10   "))
    msgs += [r.openai(content_suffix="   "), {"role": "user", "content": "日本語で一行で説明してください。"}]
    r = t.turn(oa(msgs, tools, stream=True), Out(reasoning="日本語で答える。",
                                                 content="これは果物の数量表です。りんごが3個、梨が10個。\n\n"))
    msgs += [r.openai(), {"role": "user", "content": "Now with emoji: 🍎 and 🍐, please. Also naïve café "
                                                     "(e\u0301 a\u0308)."}]
    r = t.turn(oa(msgs, tools), Out(pieces=["🍎×3 🍐×10 👩\u200d👩\u200d👧 🇫🇷 👍🏽 — cafe", "\u0301", " nai", "\u0308",
                                            "ve Z", "\u0336", "a", "\u0337", "l", "\u0338", "g", "\u0335", "o",
                                            "\u0334", " 🧪"]),
               note="combining characters sampled as separate tokens (not NFC): the echo keeps them")
    msgs += [r.openai(), {"role": "user", "content": "Run `printf 'a\\tb  \\r\\n'` for me."}]
    r = t.turn(oa(msgs, tools), Out(calls=[("run_shell", {"command": "printf 'a\\tb  \\r\\n'"})]))
    msgs += [r.openai(), *tool_results(r, ["a\tb  \r\n"])]
    r = t.turn(oa(msgs, tools, stream=True), Out(content="It printed `a`, a tab, `b`, two spaces and CRLF.\n"))
    msgs += [r.openai(), {"role": "user", "content": "Write a long essay about tabs versus spaces."}]
    r = t.turn(oa(msgs, tools, max_tokens=12), Out(
        content="Tabs versus spaces is one of the oldest debates in programming, and it is not really about "
                "whitespace at all."), note="cut by max_tokens: finish length")
    msgs += [r.openai(), {"role": "user", "content": "continue"}]
    r = t.turn(oa(msgs, tools), Out(content="...it is about who gets to decide how code looks.  \n\t"))
    msgs += [r.openai(), {"role": "user", "content": "Use the ReAct format to find big files."}]
    r = t.turn(oa(msgs, tools, stop=["Observation:"]), Out(
        content="Thought: list files by size.\nAction: ls -S | head -3\nObservation: big.bin\nmore"),
        note="ended by the stop string")
    msgs += [r.openai(), {"role": "user", "content": "Observation: big.bin  small.txt\r\n"}]
    r = t.turn(oa(msgs, tools, stop=["Observation:"], stream=True), Out(
        content="Thought: done.\nFinal Answer: big.bin is the biggest file."))
    msgs += [r.openai(), {"role": "user", "content": "👍"}]
    t.turn(oa(msgs, tools), Out(content="👋"))
    t.expect(segments=[seg("session_start", list(range(10)), boundary="finalize")],
             steps=[{"step_index": 5, "finish_reason": "length"}, {"step_index": 7, "finish_reason": "stop"}])
    return t


def t_long_session() -> Trace:
    s = "trace-200-turns"
    t = Trace(
        "tool_loop_200_turns",
        "A 200-call tool loop (199 short tool calls, then the answer), each request written as `body_extends` "
        "of the previous one. One segment, 200 steps.",
        ["long_session.200_steps", "body_extends", "one_segment"],
        session=s,
    )
    tools = [SHELL]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a shell agent. One command per call."},
        {"role": "user", "content": "Count the lines of every module, one by one, and give me the total."},
    ]
    reply = t.turn(oa(msgs, tools, max_tokens=256), Out(calls=[("run_shell", {"command": "wc -l m000.py"})]))
    total = 0
    for i in range(1, 200):
        lines = i * 7 % 50 + 3
        total += lines
        new = [reply.openai(), *tool_results(reply, [f"{lines} m{i - 1:03d}.py"])]
        out = Out(calls=[("run_shell", {"command": f"wc -l m{i:03d}.py"})]) if i < 199 else Out(
            content=f"Total: {total} lines in 199 modules.")
        reply = t.turn({"messages": new}, out, extends=i - 1)
    t.expect(segments=[seg("session_start", list(range(200)), boundary="finalize")], step_count={s: 200})
    return t


def t_retries() -> Trace:
    s = "trace-retries"
    t = Trace(
        "retries",
        "Client retries. (a) The agent re-sends the same request with the same X-Turn-Id (its HTTP client timed "
        "out); (b) it re-sends the identical message list without a turn id. The retry replaces the earlier "
        "generation: the old step becomes `superseded` (out of the segment, `superseded_by` the new index), the "
        "new one has `retry_of`; no boundary. The agent continues from the retry's reply.",
        ["retry.same_turn_id", "retry.identical_messages", "step.superseded", "no_boundary"],
        session=s,
    )
    tools = [SHELL]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": "Is nginx running?"},
    ]
    r0 = t.turn(oa(msgs, tools), Out(calls=[("run_shell", {"command": "systemctl is-active nginx"})]),
                headers={"X-Turn-Id": "turn-1"})
    msgs += [r0.openai(), *tool_results(r0, ["active"])]
    t.turn(oa(msgs, tools), Out(content="Yes, nginx is active."), headers={"X-Turn-Id": "turn-2"},
           note="the agent's HTTP client times out before reading this reply")
    r2 = t.turn(oa(msgs, tools), Out(content="Yes: nginx is active."), headers={"X-Turn-Id": "turn-2"},
                note="retry (a): same request, same X-Turn-Id")
    msgs += [r2.openai(), {"role": "user", "content": "Since when?"}]
    t.turn(oa(msgs, tools), Out(calls=[("run_shell", {"command": "systemctl show nginx -p ActiveEnterTimestamp"})]),
           note="lost to a connection reset")
    r4 = t.turn(oa(msgs, tools), Out(calls=[("run_shell", {"command": "systemctl status nginx | head -3"})]),
                note="retry (b): identical messages, no turn id")
    msgs += [r4.openai(), *tool_results(r4, ["Active: active (running) since Thu 2025-06-12 08:01:44 UTC"])]
    t.turn(oa(msgs, tools), Out(content="Since 08:01 UTC today."))
    t.expect(
        segments=[seg("session_start", [0, 2, 4, 5], boundary="finalize")],
        steps=[{"step_index": 1, "status": "superseded", "in_segment": False, "superseded_by": 2},
               {"step_index": 2, "status": "completed", "in_segment": True, "retry_of": 1},
               {"step_index": 3, "status": "superseded", "in_segment": False, "superseded_by": 4},
               {"step_index": 4, "status": "completed", "in_segment": True, "retry_of": 3}],
    )
    return t


SUB_SYSTEM = [{"type": "text", "text": "You are an agent for Claude Code, Anthropic's official CLI for Claude. "
                                       "Given the user's message, you should use the tools available to complete "
                                       "the task. Do what has been asked; nothing more, nothing less."}]
EXPLORE_SYSTEM = [{"type": "text", "text": "You are a file search specialist for Claude Code. You excel at "
                                           "thoroughly navigating and exploring codebases. Report findings "
                                           "concisely."}]
SUB_TOOLS = [t for t in CC_TOOLS if t["name"] != "Task"]


ROOT_TASK = {"role": "user", "content": [{"type": "text", "text": "test_roundtrip in tests/test_io.py fails on "
                                                                    "Windows. Find out why and fix it."}]}
TASK_CAUSE = ("Find why tests/test_io.py::test_roundtrip fails on Windows. Read src/io.py and the test; report "
              "the root cause in two sentences.")
TASK_CALLERS = "List every caller of io.write in the repository with file and line. Report the list only."
IO_SOURCE = "     1\tdef write(path, text):\n     2\t    open(path, 'w').write(text)\n"
IO_TEST = ("def test_roundtrip(tmp_path):\n    io.write(tmp_path / 'f', 'a\\n')\n    assert "
           "(tmp_path / 'f').read_bytes() == b'a\\n'")
CAUSE = ("Root cause: io.write opens the file in text mode, so on Windows '\\n' is written as '\\r\\n'. "
         "The test compares raw bytes and fails.")
CALLERS = "Callers of io.write:\n- src/cli.py:12\n- src/export.py:40"
GREP_OUT = "src/cli.py:12:    io.write(out, text)\nsrc/export.py:40:        io.write(p, s)"


def t_sub_agents_train() -> Trace:
    s = "trace-subagents-train"
    sub1, sub2 = f"{s}/sub-1", f"{s}/sub-2"
    t = Trace(
        "sub_agents_train",
        "Claude Code with Task sub-agents over /v1/messages in ONE session (per-session URL). The parent "
        "launches two Tasks in parallel; the two sub-agents' conversations (another system prompt and another "
        "first user message than the parent's) interleave turn by turn, then the parent continues with both "
        "results. Their turns go to child sessions <session>/sub-1 and <session>/sub-2 (sub-2 has the same "
        "system prompt as sub-1 but another task; its calls are not streamed, so its replies show the child "
        "session in actorproxy.session_id). The parent's segment is unbroken. Finalizing the parent "
        "finalizes the children, and reading the parent returns their segments (trajectory_id "
        "<session>/sub-N#k, metadata.sub_agent) and steps. sub_agents=train (the default).",
        ["sub_agents.routing", "sub_agents.train", "sub_agents.parallel_interleaved", "sub_agents.finalize_children",
         "sub_agents.same_system_other_task", "anthropic.messages", "anthropic.stream", "anthropic.non_stream",
         "claude_code.task_tool"],
        session=s,
    )
    kw: dict[str, Any] = {"api": "anthropic", "url": True, "headers": dict(CC_HEADERS)}
    parent: list[dict[str, Any]] = [ROOT_TASK]
    p0 = t.turn(cc_body(parent), Out(
        reasoning="Two independent questions: root cause, and who calls write. Run both as sub-agents.",
        calls=[("Task", {"description": "Root-cause test_roundtrip", "prompt": TASK_CAUSE,
                         "subagent_type": "general-purpose"}),
               ("Task", {"description": "Find io.write callers", "prompt": TASK_CALLERS,
                         "subagent_type": "general-purpose"})]), **kw)
    c1: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": TASK_CAUSE}]}]
    c2: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": TASK_CALLERS}]}]
    sub = {"system": SUB_SYSTEM, "tools": SUB_TOOLS}
    a = t.turn(cc_body(c1, **sub), Out(calls=[("Read", {"file_path": "/repo/src/io.py"})]), step_session=sub1, **kw)
    b = t.turn(cc_body(c2, **sub, stream=False), Out(
        calls=[("Grep", {"pattern": r"io\.write\(", "output_mode": "content"})]), step_session=sub2, **kw)
    c1 += [a.anthropic(), {"role": "user", "content": tool_result(a, [IO_SOURCE])}]
    a = t.turn(cc_body(c1, **sub), Out(reasoning="Text mode translates \\n to \\r\\n on Windows.",
                                       calls=[("Read", {"file_path": "/repo/tests/test_io.py"})]),
               step_session=sub1, **kw)
    c2 += [b.anthropic(), {"role": "user", "content": tool_result(b, [GREP_OUT])}]
    b = t.turn(cc_body(c2, **sub, stream=False), Out(content=CALLERS), step_session=sub2, **kw)
    c1 += [a.anthropic(), {"role": "user", "content": tool_result(a, [IO_TEST])}]
    a = t.turn(cc_body(c1, **sub), Out(content=CAUSE), step_session=sub1, **kw)
    parent += [p0.anthropic(), {"role": "user", "content": tool_result(p0, [[{"type": "text", "text": a.content}],
                                                                           [{"type": "text", "text": b.content}]])}]
    p1 = t.turn(cc_body(parent), Out(
        reasoning="Fix io.write with newline=''.",
        calls=[("Edit", {"file_path": "/repo/src/io.py", "old_string": "open(path, 'w')",
                         "new_string": "open(path, 'w', newline='')"})]), **kw)
    parent += [p1.anthropic(), {"role": "user", "content": tool_result(p1, ["The file /repo/src/io.py has been "
                                                                           "updated."])}]
    t.turn(cc_body(parent), Out(content="Fixed: io.write now opens files with newline=''. Both callers "
                                        "(src/cli.py:12, src/export.py:40) keep working."), **kw)
    t.expect(
        segments=[
            seg("session_start", [0, 1, 2], boundary="finalize"),
            seg(None, [0, 1, 2], session=sub1, trajectory_id_prefix=f"{sub1}#", metadata={"sub_agent": "sub-1"}),
            seg(None, [0, 1], session=sub2, trajectory_id_prefix=f"{sub2}#", metadata={"sub_agent": "sub-2"}),
        ],
        step_count={s: 3, sub1: 3, sub2: 2},
        steps=[{"session": sub1, "step_index": 0, "status": "completed", "session_id": sub1},
               {"session": sub2, "step_index": 1, "status": "completed", "session_id": sub2}],
    )
    return t


def t_sub_agents_log() -> Trace:
    s = "trace-subagents-log"
    sub1, sub2 = f"{s}/sub-1", f"{s}/sub-2"
    t = Trace(
        "sub_agents_log",
        "Claude Code with two Task sub-agents run one after the other, with parent turns in between: parent "
        "-> sub-1 (3 turns) -> parent -> sub-2 (another system prompt and another task, 2 turns) -> parent. "
        "Config sub_agents=log: the children's steps are recorded (session_id <session>/sub-N), no child "
        "segments; the parent's segment is unbroken; finalizing the parent finalizes the children.",
        ["sub_agents.routing", "sub_agents.log", "sub_agents.sequential", "sub_agents.finalize_children",
         "sub_agents.other_system_other_task", "anthropic.messages", "anthropic.stream", "claude_code.task_tool"],
        session=s,
        config={"sub_agents": "log"},
    )
    kw: dict[str, Any] = {"api": "anthropic", "url": True, "headers": dict(CC_HEADERS)}
    parent: list[dict[str, Any]] = [ROOT_TASK]
    p = t.turn(cc_body(parent), Out(
        reasoning="Delegate the root-cause analysis.",
        calls=[("Task", {"description": "Root-cause test_roundtrip", "prompt": TASK_CAUSE,
                         "subagent_type": "general-purpose"})]), **kw)
    sub = {"system": SUB_SYSTEM, "tools": SUB_TOOLS}
    c1: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": TASK_CAUSE}]}]
    a = t.turn(cc_body(c1, **sub), Out(calls=[("Read", {"file_path": "/repo/src/io.py"})]), step_session=sub1, **kw)
    c1 += [a.anthropic(), {"role": "user", "content": tool_result(a, [IO_SOURCE])}]
    a = t.turn(cc_body(c1, **sub), Out(calls=[("Read", {"file_path": "/repo/tests/test_io.py"})]),
               step_session=sub1, **kw)
    c1 += [a.anthropic(), {"role": "user", "content": tool_result(a, [IO_TEST])}]
    a = t.turn(cc_body(c1, **sub), Out(reasoning="Text mode.", content=CAUSE), step_session=sub1, **kw)
    parent += [p.anthropic(), {"role": "user", "content": tool_result(p, [a.content])}]
    p = t.turn(cc_body(parent), Out(
        reasoning="Before changing write, find its callers.",
        calls=[("Task", {"description": "Find io.write callers", "prompt": TASK_CALLERS,
                         "subagent_type": "Explore"})]), **kw)
    explore = {"system": EXPLORE_SYSTEM, "tools": SUB_TOOLS}
    c2: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": TASK_CALLERS}]}]
    b = t.turn(cc_body(c2, **explore), Out(calls=[("Grep", {"pattern": r"io\.write\(", "output_mode": "content"})]),
               step_session=sub2, **kw)
    c2 += [b.anthropic(), {"role": "user", "content": tool_result(b, [GREP_OUT])}]
    b = t.turn(cc_body(c2, **explore), Out(content=CALLERS), step_session=sub2, **kw)
    parent += [p.anthropic(), {"role": "user", "content": tool_result(p, [b.content])}]
    p = t.turn(cc_body(parent), Out(calls=[("Edit", {"file_path": "/repo/src/io.py", "old_string": "open(path, 'w')",
                                                     "new_string": "open(path, 'w', newline='')"})]), **kw)
    parent += [p.anthropic(), {"role": "user", "content": tool_result(p, ["The file /repo/src/io.py has been "
                                                                         "updated."])}]
    t.turn(cc_body(parent), Out(content="Fixed: io.write keeps line endings; both callers still work."), **kw)
    t.expect(
        segments=[seg("session_start", [0, 1, 2, 3], boundary="finalize")],
        step_count={s: 4, sub1: 3, sub2: 2},
        steps=[{"session": sub1, "step_index": 2, "status": "completed", "session_id": sub1},
               {"session": sub2, "step_index": 0, "status": "completed", "session_id": sub2}],
    )
    return t


def t_mode(mode: str) -> Trace:
    configs: dict[str, dict[str, Any]] = {"last_step": {"trajectory_build_mode": "last_step"},
               "recompute": {"on_history_rewrite": "recompute"},
               "verify": {"verify_tito": True}}
    t = Trace(
        f"mode_{mode}",
        "The same short conversation (reasoning replies, then the second user message edited, then a follow-up) "
        f"under config {json.dumps(configs[mode])}. Expectations are on segment count and start reasons"
        + (" and on the finalized segment's metadata.verify.unexpected == 0." if mode == "verify" else "."),
        [f"mode.{mode}"],
        session=f"trace-mode-{mode}",
        config=configs[mode],
    )
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a concise assistant."},
                                  {"role": "user", "content": "Name a prime between 10 and 20."}]
    r0 = t.turn(oa(msgs), Out(reasoning="11, 13, 17, 19 are primes.", content="13."))
    msgs += [r0.openai(), {"role": "user", "content": "Another one?"}]
    t.turn(oa(msgs), Out(reasoning="Pick 17.", content="17."))
    edited = msgs[:3] + [{"role": "user", "content": "Another one, above 15?"}]
    r2 = t.turn(oa(edited), Out(reasoning="17 or 19.", content="19."),
                note="the second user message edited: the rewritten history still holds the first reply")
    edited += [r2.openai(), {"role": "user", "content": "And the next prime after that?"}]
    t.turn(oa(edited), Out(reasoning="After 19 comes 23.", content="23."))
    if mode == "verify":
        t.expect(segments=[seg("session_start", None), seg("history_rewrite", None, boundary="finalize",
                                                             metadata={"verify": {"unexpected": 0}})])
    elif mode == "last_step":
        # Boundaries as in concat; each segment is then its last step's conversation re-rendered.
        t.expect(segments=[seg("session_start", None), seg("history_rewrite", None, boundary="finalize")])
    else:
        # The rewrite is rebuilt in place: the segment goes on.
        t.expect(segments=[seg("session_start", None, boundary="finalize")])
    return t


BUILDERS: list[Callable[[], Trace]] = [
    t_echo_reserialised, t_echo_reasoning_kept, t_qwen3_reasoning, t_compaction, t_mid_history_edit,
    t_claude_code_reminder, t_system_changed, t_tool_schema, t_tito_failure, t_parallel_calls, t_long_outputs,
    t_unicode, t_long_session, t_retries, t_sub_agents_train, t_sub_agents_log,
    partial(t_mode, "last_step"), partial(t_mode, "recompute"), partial(t_mode, "verify"),
]


def main() -> None:
    for old in HERE.glob("[0-9][0-9]_*.json"):
        old.unlink()
    for i, build in enumerate(BUILDERS, start=1):
        path = build().write(i)
        print(f"{path.name}: {path.stat().st_size // 1024} kB")


if __name__ == "__main__":
    main()
