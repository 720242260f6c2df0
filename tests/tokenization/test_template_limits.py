"""Templates that cannot render what a request holds say so (issue 31 item 6).

Gemma 3's template has no place for tools (they vanish from the prompt) and
requires strict user/assistant alternation. A template that ignores tools is
named at start-up and in a reply header of every request that offers tools; a
history the template refuses is a 400 that names the template's own rule, and
the log does not claim a new segment was started.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from _families import family_tokenizer

from actorproxy import ProxyConfig, open_proxy
from actorproxy.core.requests import merge_consecutive_messages
from actorproxy.core.template_probe import probe_template
from actorproxy.runtime.backends import output_format_for
from actorproxy.sim import SimConfig, SimEngine

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
WARNING = "x-actorproxy-warning"


@pytest.mark.parametrize(("family", "renders"), [("qwen3", True), ("llama3", True), ("gemma3", False)])
def test_the_probe_says_whether_a_template_renders_tools(family: str, renders: bool) -> None:
    assert probe_template(family_tokenizer(family)).renders_tools is renders


def test_start_up_warns_when_the_template_ignores_tools(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        output_format_for(ProxyConfig.of(), family_tokenizer("qwen3"))
    assert "ignores tools" not in caplog.text
    with caplog.at_level(logging.WARNING):
        output_format_for(ProxyConfig.of(), family_tokenizer("gemma3"))
    assert "the chat template ignores tools" in caplog.text and "X-Actorproxy-Warning" in caplog.text


@pytest.fixture
async def gemma() -> AsyncIterator[httpx.AsyncClient]:
    tok = family_tokenizer("gemma3")
    engine = SimEngine(tok, SimConfig(seed=3, token_interval=0.0005, tool_call_probability=0.0))
    async with open_proxy(ProxyConfig.of(port=0), backend=engine, tokenizer=tok) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            yield client


async def test_tools_offered_to_a_template_that_ignores_them_are_named_in_a_header(
    gemma: httpx.AsyncClient,
) -> None:
    chat = {"messages": [{"role": "user", "content": "Read main.py"}], "max_tokens": 8}
    plain = await gemma.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": "a"})
    assert plain.status_code == 200 and WARNING not in plain.headers
    for stream in (False, True):
        offered = await gemma.post("/v1/chat/completions", json={**chat, "tools": TOOLS, "stream": stream},
                                   headers={"X-Session-Id": f"b{stream}"})
        assert offered.status_code == 200, offered.text
        assert "ignores tools" in offered.headers[WARNING] and "1 tool" in offered.headers[WARNING]
    anthropic = await gemma.post("/v1/messages", headers={"X-Session-Id": "c"}, json={
        "model": "gemma", "max_tokens": 8, "messages": [{"role": "user", "content": "Read main.py"}],
        "tools": [{"name": "read_file", "input_schema": TOOLS[0]["function"]["parameters"]}]})
    assert anthropic.status_code == 200, anthropic.text
    assert "ignores tools" in anthropic.headers[WARNING]


async def test_a_history_the_template_refuses_is_a_400_naming_its_rule(
    gemma: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    first = [{"role": "user", "content": "Hello"}]
    reply = await gemma.post("/v1/chat/completions", json={"messages": first, "max_tokens": 8},
                             headers={"X-Session-Id": "s"})
    assert reply.status_code == 200
    said = reply.json()["choices"][0]["message"]
    # Two user messages in a row (Codex and opencode send such histories): Gemma 3 refuses them.
    history = [*first, {"role": "assistant", "content": said["content"]},
               {"role": "user", "content": "Look at this."}, {"role": "user", "content": "And this."}]
    with caplog.at_level(logging.INFO):
        refused = await gemma.post("/v1/chat/completions", json={"messages": history, "max_tokens": 8},
                                   headers={"X-Session-Id": "s"})
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "Conversation roles must alternate user/assistant/user/assistant" in message, message
    assert "starting a new segment" not in caplog.text, caplog.text


def test_merging_consecutive_messages_joins_user_and_system_runs_only() -> None:
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Look."}, {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "Done."}, {"role": "assistant", "content": "Really."},
        {"role": "user", "content": [{"type": "text", "text": "a part"}]}, {"role": "user", "content": "text"},
    ]
    assert merge_consecutive_messages(messages) == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Look.\n\nFix it."},
        # An assistant's turns are what the model sampled: never joined. Parts are not strings: left as sent.
        {"role": "assistant", "content": "Done."}, {"role": "assistant", "content": "Really."},
        {"role": "user", "content": [{"type": "text", "text": "a part"}]}, {"role": "user", "content": "text"},
    ]
    assert messages[0] == {"role": "system", "content": "Be brief."}  # the caller's list is not changed


async def test_with_the_flag_a_codex_style_history_renders_and_stays_one_segment() -> None:
    """Codex opens with a developer message and two user messages: Gemma 3 refuses that; merged, it renders,
    and the next turn (the same history, the reply and a tool-free user turn) continues the segment."""
    tok = family_tokenizer("gemma3")
    engine = SimEngine(tok, SimConfig(seed=3, token_interval=0.0005, tool_call_probability=0.0))
    opening = [{"role": "system", "content": "You are Codex."}, {"role": "system", "content": "Be careful."},
               {"role": "user", "content": "<environment_context>cwd=/w</environment_context>"},
               {"role": "user", "content": "Fix the bug."}]
    async with open_proxy(ProxyConfig.of(port=0, merge_consecutive_messages=True), backend=engine,
                          tokenizer=tok) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            first = await http.post("/v1/chat/completions", json={"messages": opening, "max_tokens": 8},
                                    headers={"X-Session-Id": "codex"})
            assert first.status_code == 200, first.text
            said = first.json()["choices"][0]["message"]["content"]
            later = [*opening, {"role": "assistant", "content": said}, {"role": "user", "content": "Thanks."},
                     {"role": "user", "content": "Now test it."}]
            second = await http.post("/v1/chat/completions", json={"messages": later, "max_tokens": 8},
                                     headers={"X-Session-Id": "codex"})
            assert second.status_code == 200, second.text
            await http.post("/session/finalize", json={"session_id": "codex"})
            read = (await http.post("/trajectory/read", json={"session_id": "codex", "include_steps": True})).json()
    assert [s["num_steps"] for s in read["data"]] == [2], read["data"]
    segment = read["data"][0]
    prompt = tok.render(merge_consecutive_messages(opening), add_generation_prompt=True)
    assert segment["token_ids"][: len(tok.encode_prompt(prompt))] == list(tok.encode_prompt(prompt))
    assert "Thanks.\n\nNow test it." in tok.decode(segment["token_ids"])
