"""Start llama-server and actorproxy as processes, for the real-engine tier."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from _children import die_with_parent

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "llamacpp" / "build.sh"
#: Context of the test server: room for multi-turn chats, small enough for a 2-core machine.
CTX = 8192


@attrs.frozen
class LlamaCpp:
    server: Path
    model: Path
    vocab: Path


@attrs.frozen
class Process:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def wait_for_line(proc: subprocess.Popen[bytes], log: Path, pattern: str, timeout: float) -> re.Match[str]:
    """The first match of ``pattern`` in the process's log (it fails if the process exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"process exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)  # polling a log file written by another process
    pytest.fail(f"no {pattern!r} within {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_llama_server(llamacpp: LlamaCpp, log: Path) -> Process:
    args = [
        str(llamacpp.server), "-m", str(llamacpp.model), "--host", "127.0.0.1", "--port", "0",
        "-c", str(CTX), "-np", "2", "-t", "2", "--no-webui",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    url = wait_for_line(proc, log, r"listening on (http://\S+)", 120).group(1)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # /health is 503 while the model loads
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return Process(url, proc, log)
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop(proc)
    pytest.fail(f"llama-server did not become healthy:\n{log.read_text(errors='replace')[-3000:]}")


def proxy_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "actorproxy", "run", "--port", "0", *args]


def start_proxy(log: Path, *args: str) -> Process:
    """``actorproxy run ARGS`` on a free port (its log in ``log``)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(proxy_command(*args), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                preexec_fn=die_with_parent)
    try:
        url = wait_for_line(proc, log, r"serving on (http://\S+)", 300).group(1)
    except BaseException:
        stop(proc)
        raise
    return Process(url, proc, log)


def read_session(http: httpx.Client, proxy: Process, session: str) -> dict[str, Any]:
    """Finalize a session and read it back with its steps."""
    assert http.post(f"{proxy.url}/session/finalize", json={"session_id": session}).status_code == 200
    got = http.post(f"{proxy.url}/trajectory/read", json={"session_id": session, "include_steps": True})
    assert got.status_code == 200, got.text
    return dict(got.json())


def session_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def reply_logprobs(http: httpx.Client, proxy: Process, session: str, body: dict[str, Any], *, stream: bool
                   ) -> list[Any]:
    """A chat turn's ``logprobs.content`` entries: the JSON reply's, or (``stream``) every chunk's, in order."""
    if not stream:
        got = http.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Session-Id": session})
        assert got.status_code == 200, got.text
        return list(got.json()["choices"][0]["logprobs"]["content"])
    content: list[Any] = []
    with http.stream("POST", f"{proxy.url}/v1/chat/completions", json=body | {"stream": True},
                     headers={"X-Session-Id": session}) as got:
        assert got.status_code == 200
        for line in got.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content += (choice.get("logprobs") or {}).get("content") or []
    return content


def chat(http: httpx.Client, proxy: Process, session: str, messages: list[dict[str, Any]], *, model: str,
         stream: bool, **extra: Any) -> tuple[dict[str, Any], str]:
    """One turn through the proxy: the assistant message as the agent saw it (from the stream's deltas when
    ``stream``), and the finish reason."""
    body = {"model": model, "messages": messages, "temperature": 0.0, "stream": stream, **extra}
    headers = {"X-Session-Id": session}
    if not stream:
        got = http.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers)
        assert got.status_code == 200, got.text
        choice = got.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with http.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, headers=headers) as got:
        assert got.status_code == 200
        for line in got.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or "")
                for call in delta.get("tool_calls") or ():
                    entry = calls.setdefault(call["index"], {"id": call.get("id"), "type": "function",
                                                             "function": {"name": "", "arguments": ""}})
                    entry["function"]["name"] += call.get("function", {}).get("name") or ""
                    entry["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, str(finish)


def stream_until(proxy: Process, session: str, body: dict[str, Any], deltas: int, started: threading.Event,
                 out: list[str], *, hang_up: bool = False) -> None:
    """Stream a turn in a thread: ``started`` is set after ``deltas`` pieces of text (then hang up if asked).

    A piece is content or reasoning: the random model's reply may stay inside ``<think>``. An error
    event ends the stream: it is kept in ``out`` as ``ERROR {...}`` (see :func:`stream_errors`)."""
    try:
        with httpx.Client(timeout=300) as http, http.stream(
            "POST", f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Session-Id": session}
        ) as got:
            for line in got.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.append(f"ERROR {event}")
                    return
                for choice in event["choices"]:
                    delta = choice["delta"]
                    out.append(delta.get("content") or delta.get("reasoning_content") or "")
                if sum(1 for piece in out if piece) >= deltas:
                    started.set()
                    if hang_up:
                        return
    finally:
        started.set()  # also when the stream failed: the test goes on and reports it


def stream_errors(outs: list[list[str]]) -> list[str]:
    """The error events the streams of :func:`stream_until` ended with."""
    return [piece for out in outs for piece in out if piece.startswith("ERROR ")]
