"""actorproxy against a real llama-server running gemma-3-270m on the CPU.

* our GGUF tokenizer encodes thousands of varied strings exactly as llama-server's /tokenize;
* the built-in qwen3 tokenizer in front of this Gemma server refuses to start, in one line;
* multi-turn chats, streamed and not: every recorded step's sampled ids and logprobs are what the
  engine returns for that prompt (greedy, replayed on /completion), and their text is what the
  client saw; the turns continue one another (one segment per session);
* a pause in the middle of a streamed generation: the stream resumes and the recorded output is
  still the engine's greedy continuation;
* max_tokens and stop strings; vLLM's ignore_eos and stop_token_ids, and min_tokens refused (llama-server has none).
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from realengine_util import (
    REPO,
    LlamaCpp,
    Process,
    proxy_command,
    read_session,
    reply_logprobs,
    session_id,
    start_proxy,
    stop,
    stream_until,
)
from realengine_util import chat as proxy_chat

from actorproxy.tokenization.gguf import build_tokenizer
from actorproxy.tokenization.gguf_file import read_vocab
from actorproxy.tokenization.tokenizer import ChatTokenizer, load_tokenizer

# The tier installs or starts something big: `-m "not heavy"` leaves it out (README.md).
pytestmark = [pytest.mark.heavy, pytest.mark.realengine]

SPECIAL_TEXTS = [
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unused7>", "<table>", "</td>", "<b>",
    "[multimodal]", "<start_of_image>", "<start_of_tur", "end_of_turn>", "<0x41>", "<0x0A>", "▁", "▁▁x",
]
PIECES = [
    "Hello", "world", " the", "quick brown fox", "don't", "I'LL", "naïve café", "Straße", "ÆØÅ",
    "日本語のテキスト", "中文字符", "한국어", "Привет, мир", "مرحبا", "שלום", "हिन्दी", "ไทย", "Ελληνικά",
    "🦙", "👩‍👩‍👧", "👍🏽", "🇫🇷", "e\u0301", "\u00a0", "\u200b", "\u3000", "\ufeff", "\ufffd",
    "0", "7", "42", "1234567890", "3.14159", "-1e-9", "0x1F", "2025-06-01", "12:34:56",
    "def f(x):\n    return x ** 2\n", "if (a && b) { c(); }", "x = [1, 2, 3]", "SELECT * FROM t;",
    "<div class=\"a\">", "{\"key\": [true, null]}", "#include <stdio.h>", "$ ls -la | grep '^d'",
    "!!!", "...", "—", "“quoted”", "«»", "~`^", "\\n", "@#%&*",
]
WHITESPACE = [" ", "  ", "   ", "    ", " " * 17, " " * 40, "\t", "\t\t", "\n", "\n\n", "\n" * 5, "\n" * 35,
              "\r\n", " \n ", "\t \n", "\n  \n", " \t"]


def varied_strings(count: int, seed: int = 16) -> list[str]:
    rng = random.Random(seed)
    out = [*SPECIAL_TEXTS, *PIECES, *WHITESPACE]
    while len(out) < count:
        parts = []
        for _ in range(rng.randint(1, 10)):
            kind = rng.random()
            if kind < 0.45:
                parts.append(rng.choice(PIECES))
            elif kind < 0.7:
                parts.append(rng.choice(WHITESPACE))
            elif kind < 0.8:
                parts.append(rng.choice(SPECIAL_TEXTS))
            elif kind < 0.9:
                parts.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 6))))
            else:
                parts.append("".join(chr(rng.randint(0x10000, 0x1FAFF)) for _ in range(rng.randint(1, 3))))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def gemma(llamacpp: LlamaCpp) -> ChatTokenizer:
    return load_tokenizer(str(llamacpp.model))


def engine_tokenize(http: httpx.Client, url: str, text: str) -> list[int]:
    got = http.post(f"{url}/tokenize", json={"content": text, "add_special": False, "parse_special": True})
    got.raise_for_status()
    return list(got.json()["tokens"])


def test_tokenizer_matches_llama_server(llama_server: Process, gemma: ChatTokenizer) -> None:
    texts = varied_strings(3000)
    mismatches = []
    with httpx.Client(timeout=30) as http:
        for text in texts:
            theirs = engine_tokenize(http, llama_server.url, text)
            if list(gemma.encode(text)) != theirs:
                mismatches.append((text, theirs, list(gemma.encode(text))))
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, first: {mismatches[:3]}"


def test_tokenizer_matches_llama_cpp_vectors(llamacpp: LlamaCpp) -> None:
    """llama.cpp's own test vectors (tests/test-tokenizer-0) for ten tokenizer families."""
    files = sorted(llamacpp.vocab.glob("ggml-vocab-*.gguf"))
    assert len(files) >= 10
    for path in files:
        tok = build_tokenizer(read_vocab(path))
        inputs = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
        outputs = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
        for text, want in zip(inputs, outputs, strict=False):
            assert tok.encode(text, add_special_tokens=False).ids == [int(x) for x in want.split()], (path.name, text)


def test_builtin_qwen3_tokenizer_refuses_gemma(llama_server: Process, tmp_path: Path) -> None:
    done = subprocess.run(
        proxy_command("--backend", "llamacpp", "--backend-url", llama_server.url),
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("actorproxy: --tokenizer-path: tokenizer mismatch with the engine at"), done.stderr[-2000:]
    assert "262144" in last and "'qwen3'" in last
    # `actorproxy check` says the same, as its engines line.
    checked = subprocess.run(
        [sys.executable, "-m", "actorproxy", "check", "--backend", "llamacpp", "--backend-url", llama_server.url],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert checked.returncode == 2
    assert "FAIL engines: --tokenizer-path: tokenizer mismatch" in checked.stdout, checked.stdout


# -- chats through the proxy --------------------------------------------------------------------

def chat(http: httpx.Client, proxy: Process, session: str, messages: list[dict[str, Any]], *, stream: bool,
         **extra: Any) -> tuple[str, str]:
    """One turn; the reply text as the client saw it and the finish reason."""
    message, finish = proxy_chat(http, proxy, session, messages, model="gemma", stream=stream, **extra)
    return message["content"] or "", finish


def replay(http: httpx.Client, engine: Process, prompt: list[int], n: int) -> tuple[list[int], list[Any]]:
    """What llama-server samples greedily after ``prompt``: ids, and each one's top-2 logprobs."""
    body = {
        "prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
        "repeat_penalty": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "n_probs": 2,
        "return_tokens": True, "stream": False, "cache_prompt": False,
    }
    got = http.post(f"{engine.url}/completion", json=body)
    assert got.status_code == 200, got.text
    data = got.json()
    return list(data["tokens"]), list(data["completion_probabilities"])


def agreeing_prefix(ours: list[int], logprobs: list[float], theirs: list[int], probs: list[Any]) -> int:
    """How many of our sampled ids the greedy replay confirms.

    The replay prefills the prompt in one batch, the proxy's turn reused the slot's cached prefix
    (or, after a pause, re-prefilled the partial reply): CPU kernels then round differently, and a
    greedy choice between two near-equal tokens may flip. A difference is accepted only there:
    our token must be the replay's runner-up within 0.5 nats; everything before it must be equal.
    """
    for i, (mine, replayed) in enumerate(zip(ours, theirs, strict=False)):
        top = probs[i]["top_logprobs"]
        # Logprobs are the engine's own but not reproducible across prefill shapes on this quantized
        # CPU path (0.67 nats apart on one token in one run): only their sanity is checked.
        assert logprobs[i] <= 0.0 and logprobs[i] > -100.0, (i, logprobs[i])
        if mine != replayed:
            assert [t["id"] for t in top[:2]] == [replayed, mine], (i, mine, top)
            assert top[0]["logprob"] - top[1]["logprob"] < 0.5, (i, top)
            return i
    assert len(ours) == len(theirs)
    return len(ours)


def check_steps_against_engine(
    http: httpx.Client, engine: Process, gemma: ChatTokenizer, read: dict[str, Any], client_texts: list[str]
) -> list[int]:
    """Each completed step against a greedy replay of its prompt; the counts of confirmed ids."""
    steps = [s for s in read["steps"] if s["status"] == "completed"]
    assert len(steps) == len(client_texts)
    segment = read["data"][0]
    confirmed = []
    for step, seen in zip(steps, client_texts, strict=True):
        prompt = segment["token_ids"][: step["prompt_tokens"]]
        assert segment["token_ids"][step["prompt_tokens"] : step["prompt_tokens"] + len(step["output_ids"])] == (
            step["output_ids"]
        )
        ids, probs = replay(http, engine, prompt, len(step["output_ids"]))
        confirmed.append(agreeing_prefix(step["output_ids"], step["output_logprobs"], ids, probs))
        visible = [t for t in step["output_ids"] if t not in gemma.stop_token_ids]
        assert gemma.decode(visible).strip() == seen.strip()
    return confirmed


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_chat(proxy: Process, llama_server: Process, gemma: ChatTokenizer, stream: bool) -> None:
    session = session_id("chat")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer in one short sentence."}]
    seen = []
    with httpx.Client(timeout=300) as http:
        for question in ("What is the capital of France?", "And of Italy?", "Which one is larger?"):
            messages.append({"role": "user", "content": question})
            text, finish = chat(http, proxy, session, messages, stream=stream, max_tokens=48)
            assert finish in ("stop", "length")
            seen.append(text)
            messages.append({"role": "assistant", "content": text})
        read = read_session(http, proxy, session)
        # The three turns continue one another: one segment, whose prompts are prefixes.
        assert [s["boundary_reason"] for s in read["data"]] == ["finalize"], read["data"]
        check_steps_against_engine(http, llama_server, gemma, read, seen)


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_are_the_engines(proxy: Process, gemma: ChatTokenizer, stream: bool) -> None:
    """``top_logprobs: 2`` on a greedy turn: each token lists llama-server's 2 likeliest (``n_probs``), the
    likeliest first, spelled by the model's tokenizer; the first is the token sampled, with its logprob."""
    session = session_id("top")
    body = {"model": "gemma", "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0.0,
            "max_tokens": 8, "logprobs": True, "top_logprobs": 2}
    with httpx.Client(timeout=300) as http:
        content = reply_logprobs(http, proxy, session, body, stream=stream)
        [step] = read_session(http, proxy, session)["steps"]
    assert len(content) == len(step["output_ids"]) > 0
    vocabulary = {gemma.decode([t]).encode() for t in range(gemma.vocab_size)}
    for entry in content:
        first, second = entry["top_logprobs"]
        assert (first["token"], first["logprob"]) == (entry["token"], entry["logprob"])
        assert first["logprob"] >= second["logprob"] and second["logprob"] > -100.0
        assert bytes(second["bytes"]) in vocabulary, second


def test_its_logprobs_are_the_models_own_at_any_temperature(llama_server: Process, gemma: ChatTokenizer) -> None:
    """What docs/trajectories.md says of llama.cpp's logprobs, on the real server, with the body the proxy sends
    (``n_probs`` without ``post_sampling_probs``): the sampled token's logprob is the model's own, the same at
    temperature 0.3 as at 1 (``top_k: 1`` samples the same token at both); ``post_sampling_probs`` would give the
    distribution the token was drawn from instead (here a probability of 1)."""
    prompt = list(gemma.encode(gemma.render([{"role": "user", "content": "Name a colour."}])))

    def first(temperature: float, **more: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": 1, "temperature": temperature, "top_k": 1, "n_probs": 1,
                "return_tokens": True, "stream": False, "cache_prompt": False, **more}
        got = http.post(f"{llama_server.url}/completion", json=body)
        assert got.status_code == 200, got.text
        return dict(got.json()["completion_probabilities"][0])

    with httpx.Client(timeout=300) as http:
        warm, cool = first(1.0), first(0.3)
        drawn = first(0.3, post_sampling_probs=True)
    assert warm["id"] == cool["id"] == drawn["id"]
    assert cool["logprob"] == pytest.approx(warm["logprob"], abs=1e-4) and warm["logprob"] < -1e-3
    assert drawn["prob"] == pytest.approx(1.0)


def test_max_tokens_and_stop(proxy: Process, llama_server: Process, gemma: ChatTokenizer) -> None:
    question = [{"role": "user", "content": "Write three sentences about the sea."}]
    with httpx.Client(timeout=300) as http:
        text, finish = chat(http, proxy, session_id("len"), question, stream=False, max_tokens=5)
        assert finish == "length"
        session = session_id("full")
        full, _ = chat(http, proxy, session, question, stream=False, max_tokens=60)
        assert full.startswith(text)
        steps = read_session(http, proxy, session)["steps"]
        assert steps[0]["completion_tokens"] <= 60
        # A stop string from the reply cuts it there, streamed and not, and the space before it stays
        # (OpenAI's rule): the stop word is always one that follows a space, and its first occurrence
        # in the reply is that one (the tiny model repeats itself, so a later word may have none).
        candidates = [(i, full[i:].split()[0]) for i in range(1, len(full))
                      if full[i - 1] == " " and full[i : i + 3].isalpha()]
        at, stop = next(((i, word) for i, word in candidates if full.index(word) == i), (-1, ""))
        assert at > 0, repr(full)
        for stream in (False, True):
            got, finish = chat(http, proxy, session_id("stop"), question, stream=stream,
                               max_tokens=60, stop=[stop])
            assert finish == "stop"
            assert got == full[:at] and got.endswith(" ")


def test_ignore_eos_and_the_calls_stop_ids(proxy: Process, gemma: ChatTokenizer) -> None:
    """vLLM's sampling extensions in front of llama-server: ``ignore_eos`` is sent (the reply runs to its budget,
    no end-of-generation id sampled, the step records it); a stop id of the call's own, which the client enforces,
    ends a reply at its first sampling; ``min_tokens``, which llama-server has not, is a 400 saying so."""
    question = [{"role": "user", "content": "Say hi."}]
    with httpx.Client(timeout=300) as http:
        session = session_id("ignores")
        _, finish = chat(http, proxy, session, question, stream=True, max_tokens=40, ignore_eos=True)
        [ignored] = read_session(http, proxy, session)["steps"]
        assert finish == "length" and len(ignored["output_ids"]) == 40
        assert not set(ignored["output_ids"]) & set(gemma.stop_token_ids)
        assert ignored["sampling"]["ignore_eos"] is True
        session = session_id("plain")
        chat(http, proxy, session, question, stream=False, max_tokens=40)
        [plain] = read_session(http, proxy, session)["steps"]
        stop = plain["output_ids"][1]
        session = session_id("own-stop")
        _, finish = chat(http, proxy, session, question, stream=False, max_tokens=40, stop_token_ids=[stop])
        [stopped] = read_session(http, proxy, session)["steps"]
        assert finish == "stop" and stopped["output_ids"][-1] == stop and stop not in stopped["output_ids"][:-1]
        refused = http.post(f"{proxy.url}/v1/chat/completions", headers={"X-Session-Id": session_id("min")},
                            json={"model": "gemma", "messages": question, "min_tokens": 4})
        assert refused.status_code == 400 and "min_tokens is not supported by llama.cpp" in refused.text


def test_pause_in_the_middle_of_a_generation(proxy: Process, llama_server: Process, gemma: ChatTokenizer) -> None:
    session = session_id("pause")
    messages = [{"role": "user", "content": "Count from one to forty in words, separated by commas."}]
    body = {"model": "gemma", "messages": messages, "temperature": 0.0, "stream": True, "max_tokens": 160}
    pieces: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=stream_until, args=(proxy, session, body, 5, started, pieces))
    reader.start()
    with httpx.Client(timeout=300) as http:
        assert started.wait(300)
        paused = http.post(f"{proxy.url}/v1/rollout/pause", json={"mode": "abort"}).json()
        assert paused["status"] == "paused"
        state = http.get(f"{proxy.url}/v1/rollout/pause_state").json()
        assert state["state"] == "paused"
        resumed = http.post(f"{proxy.url}/v1/rollout/resume", json={}).json()
        assert resumed["status"] == "running"
        reader.join(300)
        assert not reader.is_alive() and not [p for p in pieces if p.startswith("ERROR")], pieces
        read = read_session(http, proxy, session)
        step = read["steps"][0]
        assert paused["aborted"] == 1 and step["preemptions"] == 1, (paused, step["preemptions"])
        # The ids before the pause are the engine's greedy ones; after it, the continuation of the
        # re-prefilled partial reply (confirmed up to a near tie); the text is what the client saw.
        confirmed = check_steps_against_engine(http, llama_server, gemma, read, ["".join(pieces)])
        assert confirmed[0] >= min(paused["partial_tokens"], len(step["output_ids"])) or confirmed[0] > 0


#: What Codex sends first (a developer message, then its environment context and the task as two user
#: messages) with one tool: Gemma 3's template refuses the run of user messages and has no place for tools.
CODEX_OPENING: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "<environment_context>cwd=/work</environment_context>"},
    {"role": "user", "content": "What is 2 + 2?"},
]
SHELL = [{"type": "function", "function": {"name": "shell", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def test_gemma_refuses_a_codex_opening_unless_merged(proxy: Process, llamacpp: LlamaCpp, llama_server: Process,
                                                     tmp_path: Path) -> None:
    """Through a real Gemma 3 llama-server: the 400 names the template's rule; with --merge-consecutive-messages
    the same opening runs, its reply says the tools were not in the prompt, and two turns stay one segment."""
    body = {"model": "gemma", "messages": CODEX_OPENING, "tools": SHELL, "max_tokens": 16, "temperature": 0.0}
    with httpx.Client(timeout=300) as http:
        refused = http.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "codex-plain"})
        assert refused.status_code == 400, refused.text
        assert "Conversation roles must alternate" in refused.json()["error"]["message"]
        merged = start_proxy(tmp_path / "merged.log", "--backend", "llamacpp", "--backend-url", llama_server.url,
                             "--tokenizer-path", str(llamacpp.model), "--merge-consecutive-messages",
                             "--data-dir", str(tmp_path / "data"))
        try:
            assert "the chat template ignores tools" in merged.log.read_text()
            first = http.post(f"{merged.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "codex"})
            assert first.status_code == 200, first.text
            assert "ignores tools" in first.headers["x-actorproxy-warning"]
            said = first.json()["choices"][0]["message"]["content"]
            later = [*CODEX_OPENING, {"role": "assistant", "content": said},
                     {"role": "user", "content": "Thanks."}, {"role": "user", "content": "And 3 + 3?"}]
            second = http.post(f"{merged.url}/v1/chat/completions", json={**body, "messages": later},
                               headers={"X-Session-Id": "codex"})
            assert second.status_code == 200, second.text
            read = read_session(http, merged, "codex")
        finally:
            stop(merged.proc)
    assert [s["num_steps"] for s in read["data"]] == [2], read["data"]
