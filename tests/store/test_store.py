"""The trajectory stores: memory and SQLite behave alike; SQLite journals, recovers and never drops."""

from __future__ import annotations

import shutil
import tracemalloc
import weakref
from array import array
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
from _asgi import open_client
from _util import run_turn

from actorproxy.config import ProxyConfig
from actorproxy.core.records import Segment, Step, build_segment
from actorproxy.engines.ids_json import IdsJSON
from actorproxy.errors import StorageFull
from actorproxy.protocols.anthropic_messages import AnthropicMemo
from actorproxy.protocols.chat_messages import ChatMemo
from actorproxy.protocols.responses_memo import ResponsesMemo
from actorproxy.runtime import freed_memory, store_messages
from actorproxy.runtime import store as st
from actorproxy.runtime.replies import FinalizeResult
from actorproxy.runtime.runtime import open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.schema.prefixes import Prefixes
from actorproxy.schema.records import ReadResult, StoredRead
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.store.base import ReadQuery
from actorproxy.store.codec import Rows
from actorproxy.store.memory import MemoryStore
from actorproxy.store.sqlite import DB_FILE, SQLiteStore
from actorproxy.testing import open_simulated_proxy
from actorproxy.tokenization.prompt_cache import PromptCache

HI = [{"role": "user", "content": "hi"}]


def _engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))


def _config(kind: str, tmp_path: Path, **fields: Any) -> ProxyConfig:
    return ProxyConfig.of(port=0, store_kind=kind, data_dir=str(tmp_path / "data"), **fields)


async def _two_turns(runtime: Any, session: str) -> list[Any]:
    first = await run_turn(runtime, session, HI)
    second = await run_turn(runtime, session, [*HI, first.message, {"role": "user", "content": "more"}])
    return [first, second]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_stores_answer_alike(kind: str, tmp_path: Path, tokenizer: Any) -> None:
    async with open_runtime(_config(kind, tmp_path), backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        await _two_turns(runtime, "a")
        await run_turn(runtime, "b", HI)
        assert (await runtime.finalize("a", reward=1.0)).segments == 1
        await runtime.finalize("b")
        a = CONVERTER.unstructure(await runtime.read(session_id="a", include_steps=True))
        assert [s["trajectory_id"] for s in a["data"]] == ["a#0"] and a["data"][0]["reward"] == 1.0
        assert [s["step_index"] for s in a["steps"]] == [0, 1]
        seg = a["data"][0]
        assert seg["token_ids"] == a["steps"][0]["concat_token_ids"] + a["steps"][1]["concat_token_ids"]
        assert len(seg["loss_mask"]) == len(seg["logprobs"]) == len(seg["versions"]) == seg["num_tokens"]
        one = CONVERTER.unstructure(await runtime.read(trajectory_id="b#0"))
        assert one["data"][0]["token_ids"] == (await runtime.read(session_id="b")).data[0].token_ids.tolist()
        stats = await runtime.store_stats()
        assert stats["store"] == kind and stats["segments"] == 2 and stats["steps"] == 3 and stats["sessions"] == 2
        assert await runtime.finalize("a") == FinalizeResult("a", segments=0, steps=0)  # known, retired
        drained = CONVERTER.unstructure(await runtime.read(drain=True, include_steps=True))
        assert sorted(s["trajectory_id"] for s in drained["data"]) == ["a#0", "b#0"] and len(drained["steps"]) == 3
        after = await runtime.store_stats()
        assert after["segments"] == after["steps"] == after["tokens"] == after["sessions"] == 0
        assert after["segments_drained"] == 2


async def test_sqlite_keeps_data_across_restarts_and_not_in_memory(tmp_path: Path, tokenizer: Any) -> None:
    config = _config("sqlite", tmp_path)
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        await _two_turns(runtime, "a")
        await runtime.finalize("a")
        before = CONVERTER.unstructure(await runtime.read(session_id="a", include_steps=True))
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        assert CONVERTER.unstructure(await runtime.read(session_id="a", include_steps=True)) == before
        stats = await runtime.store_stats()
        assert stats["segments"] == 1 and stats["journal_steps"] == 0
        # A finalized session's id used again continues its numbering: no step or trajectory id is reused.
        again = await run_turn(runtime, "a", HI)
        assert again.done is not None and again.done.step_index == 2
        await runtime.finalize("a")
        ids = [s["trajectory_id"] for s in CONVERTER.unstructure(await runtime.read(session_id="a"))["data"]]
        assert ids == ["a#0", "a#1"]


async def test_the_sessions_a_store_holds_come_back_oldest_first(tmp_path: Path, tokenizer: Any) -> None:
    """The registry keeps the numbering of the newest sessions the store holds when they are more than it
    remembers: the store names them oldest first (they came in the order of their ids before)."""
    config = _config("sqlite", tmp_path)
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        for session in ("zeta", "alpha", "mid"):
            await run_turn(runtime, session, HI)
            await runtime.finalize(session)
    store = SQLiteStore(config.store.data_dir)
    try:
        assert list(store.recover()) == ["zeta", "alpha", "mid"]
    finally:
        store.close()


def _crash_copy(data_dir: str, to: Path) -> str:
    """The database files as a SIGKILL at this moment would leave them (no transaction is open)."""
    to.mkdir()
    for suffix in ("", "-wal"):
        source = Path(data_dir) / (DB_FILE + suffix)
        if source.exists():
            shutil.copyfile(source, to / (DB_FILE + suffix))
    return str(to)


async def test_journal_recovers_open_sessions_after_a_crash(tmp_path: Path, tokenizer: Any) -> None:
    config = _config("sqlite", tmp_path)
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        turns = await _two_turns(runtime, "open")
        await run_turn(runtime, "done", HI)
        await runtime.finalize("done")
        stats = await runtime.store_stats()  # ordered after the journal writes: they are committed
        assert stats["journal_steps"] == 2
        crashed = _crash_copy(config.store.data_dir, tmp_path / "crashed")
    async with open_runtime(config.evolve(data_dir=crashed), backend=_engine(tokenizer),
                            tokenizer=tokenizer) as runtime:
        stats = await runtime.store_stats()
        assert stats["recovered_steps"] == 2 and stats["recovered_segments"] == 1 and stats["journal_steps"] == 0
        got = CONVERTER.unstructure(await runtime.read(session_id="open", include_steps=True))
        (seg,) = got["data"]
        assert seg["trajectory_id"] == "open#0" and seg["boundary_reason"] == "recovered"
        assert seg["metadata"]["recovered"] is True and seg["step_indices"] == [0, 1]
        # How the steps were sampled survives the crash: the journal kept it.
        assert seg["metadata"]["sampling"]["temperature"] == 1.0
        assert [s["sampling"] for s in got["steps"]] == [seg["metadata"]["sampling"]] * 2
        assert [len(s["output_ids"]) for s in got["steps"]] == [t.done.completion_tokens for t in turns]
        assert seg["token_ids"] == got["steps"][0]["concat_token_ids"] + got["steps"][1]["concat_token_ids"]
        assert len(CONVERTER.unstructure(await runtime.read(session_id="done"))["data"]) == 1
        # The session's next turn starts a fresh segment; no step or trajectory id is reused.
        turn = await run_turn(runtime, "open", HI)
        assert turn.done is not None and turn.done.step_index == 2
        await runtime.finalize("open")
        ids = [s["trajectory_id"] for s in CONVERTER.unstructure(await runtime.read(session_id="open"))["data"]]
        assert ids == ["open#0", "open#1"]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_full_store_refuses_new_turns_and_drops_nothing(kind: str, tmp_path: Path, tokenizer: Any) -> None:
    """Issue 11 #7: the oldest sessions were dropped silently (finalize 200, later read 404)."""
    config = _config(kind, tmp_path, store_max_tokens=150)
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        for name in ("old", "new"):
            await run_turn(runtime, name, HI)
            await runtime.finalize(name)
        with pytest.raises(StorageFull) as refused:
            await run_turn(runtime, "third", HI)
        assert refused.value.status == 507 and refused.value.retry_after and refused.value.code == "store_full"
        stats = await runtime.store_stats()
        assert stats["full"] and stats["refused_turns"] == 1
        for name in ("old", "new"):  # nothing was dropped
            assert CONVERTER.unstructure(await runtime.read(session_id=name))["data"]
        await runtime.read(drain=True)
        assert (await run_turn(runtime, "third", HI)).done is not None


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_drain_that_cannot_be_serialised_deletes_nothing(
    kind: str, tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11 #2: a drain is all or nothing: serialised first, deleted only after."""
    async with open_runtime(_config(kind, tmp_path), backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        await run_turn(runtime, "a", HI)
        await runtime.finalize("a")

        def broken(_: Any) -> bytes:
            raise ValueError("cannot serialise")

        monkeypatch.setattr(st, "encode_parts", broken)
        with pytest.raises(ValueError):
            await runtime.read_reply(ReadQuery(drain=True, include_steps=True))
        monkeypatch.undo()
        assert len(CONVERTER.unstructure(await runtime.read(session_id="a", include_steps=True))["steps"]) == 1


async def test_drain_with_invalid_unicode_delivers_everything(tokenizer: Any) -> None:
    """Issue 11 #2: a lone surrogate in one session made a draining read answer 500 after deleting all."""
    # In-process HTTP: what is tested is the app's answers, not the socket.
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await run_turn(sim.runtime, "bad", [{"role": "user", "content": "hi", "name": "x\udc80"}])
        await run_turn(sim.runtime, "bystander", HI)
        await sim.runtime.finalize("bad")
        await sim.runtime.finalize("bystander")
        drained = await http.post("/trajectory/read", json={"include_steps": True, "drain": True})
        assert drained.status_code == 200
        assert sorted(s["trajectory_id"] for s in drained.json()["data"]) == ["bad#0", "bystander#0"]
        assert len(drained.json()["steps"]) == 2


async def test_a_drain_streams_the_bytes_of_the_whole_read(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: a drain's reply is sent in parts (chunked, no length), byte for byte the whole read's JSON."""
    monkeypatch.setattr(store_messages, "PART_BYTES", 2000)  # many parts
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        for i in range(6):
            await run_turn(sim.runtime, f"s{i}", HI)
            await sim.runtime.finalize(f"s{i}")
        whole = orjson.dumps(CONVERTER.unstructure(await sim.runtime.read(include_steps=True)))
        assert len(whole) > 5 * store_messages.PART_BYTES
        drained = await http.post("/trajectory/read", json={"include_steps": True, "drain": True})
        assert drained.status_code == 200
        assert drained.content == whole
        assert "content-length" not in drained.headers
        assert (await http.post("/trajectory/read", json={"drain": True})).json() == {"data": []}


async def test_a_whole_store_drain_gives_memory_back_once_its_reply_is_sent(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: the allocator was asked to give pages back before the reply was sent, so the reply's own
    pages (its encoded parts) stayed with the process. Now once the last part is sent, and only after a
    drain of the whole store."""
    monkeypatch.setattr(store_messages, "PART_BYTES", 2000)  # many parts
    sent: list[int] = []
    given_back_at: list[int] = []  # bytes of the reply sent when the allocator was asked
    monkeypatch.setattr(freed_memory, "give_back", lambda: given_back_at.append(sum(sent)) or True)
    async with open_simulated_proxy(tokenizer=tokenizer) as sim:
        app = create_app(sim.runtime)

        async def counting(scope: Any, receive: Any, send: Any) -> None:
            async def counted(message: dict[str, Any]) -> None:
                await send(message)
                if message["type"] == "http.response.body":
                    sent.append(len(message.get("body", b"")))

            await app(scope, receive, counted)

        async with open_client(counting) as http:
            for i in range(6):
                await run_turn(sim.runtime, f"s{i}", HI)
                await sim.runtime.finalize(f"s{i}")
            one = await http.post("/trajectory/read", json={"session_id": "s0", "drain": True})
            assert one.status_code == 200 and given_back_at == []  # not the whole store: nothing asked
            sent.clear()
            drained = await http.post("/trajectory/read", json={"include_steps": True, "drain": True})
            assert drained.status_code == 200 and len(drained.content) > 5 * store_messages.PART_BYTES
    assert given_back_at == [len(drained.content) - 2]  # every part sent: only its end ("]}") waits for the delete


async def test_a_whole_store_drain_ages_the_body_memos_of_every_route(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: the body memos kept every drained session's messages until they reached their bound, and RSS
    grew drain after drain. After a drain of the whole store (only then) each route's memo is aged."""
    aged: list[str] = []
    for memo in (ChatMemo, AnthropicMemo, ResponsesMemo):
        monkeypatch.setattr(memo, "age", lambda self: aged.append(type(self).__name__))
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        for i in range(2):
            await run_turn(sim.runtime, f"s{i}", HI)
            await sim.runtime.finalize(f"s{i}")
        assert (await http.post("/trajectory/read", json={"session_id": "s0", "drain": True})).status_code == 200
        assert (await http.post("/trajectory/read", json={"drain": False})).status_code == 200
        assert aged == []
        assert (await http.post("/trajectory/read", json={"drain": True})).status_code == 200
    assert sorted(aged) == ["AnthropicMemo", "ChatMemo", "ResponsesMemo"]


async def test_a_whole_store_drain_ages_the_body_prefixes_and_the_prompt_caches(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memos' kept bodies and the tokenizer's prompt cache hold whole conversations, a session's data:
    they were only bounded by their bytes. After a drain of the whole store (only then) they age too."""
    aged: list[str] = []
    monkeypatch.setattr(Prefixes, "age", lambda self: aged.append("bodies"), raising=False)
    monkeypatch.setattr(PromptCache, "age", lambda self: aged.append("prompts"), raising=False)
    monkeypatch.setattr(IdsJSON, "age", lambda self: aged.append("engine prompts"), raising=False)
    long_system = {"role": "system", "content": "Follow the rules of the repository. " * 60}
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        for i in range(2):
            await run_turn(sim.runtime, f"s{i}", [long_system, *HI])  # a prompt the cache keeps
            await sim.runtime.finalize(f"s{i}")
        assert (await http.post("/trajectory/read", json={"session_id": "s0", "drain": True})).status_code == 200
        assert aged == []
        assert (await http.post("/trajectory/read", json={"drain": True})).status_code == 200
    assert aged.count("prompts") == 1 and aged.count("bodies") >= 3  # one memo a route at least
    assert aged.count("engine prompts") == 1  # the prompts' JSON kept for the engine requests (engines/ids_json.py)


def _segment(i: int, tokens: int) -> Segment:
    return Segment(f"t{i}#0", f"t{i}#0", None, "r", 0, array("i", range(tokens)), array("b", [1] * tokens),
                   array("f", [-0.5] * tokens), array("i", [3] * tokens), (0,), "session_start", "finalize")


def test_a_large_read_never_holds_its_whole_body_as_objects() -> None:
    """Issue 33: 2 M tokens (26 MB of JSON) took 147 MB to read: every array a list of Python numbers at once.

    Encoded one segment at a time, a read's peak is its JSON and one segment's lists.
    """
    result = ReadResult([_segment(i, 20_000) for i in range(50)])
    tracemalloc.start()
    try:
        parts = store_messages.encode_parts(result)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = sum(map(len, parts))
    assert b"".join(parts) == orjson.dumps(CONVERTER.unstructure(result))
    assert peak <= 1.5 * size, f"peak {peak / size:.1f}x the body"  # the whole body as objects: 8.4x


def _varied(i: int) -> tuple[Segment, list[Step]]:
    """A segment of two steps whose fields vary with ``i``: text outside ASCII, odd floats, the optional payloads."""
    steps = []
    for k in range(2):
        step = Step(index=k, session_id=f"v{i:02d}", segment_index=0, turn_id=f"turn \u00e9{i}" if i % 2 else None,
                    instance_id="g" if i % 3 else None, new_messages=[{"role": "user", "content": f"q{k} \u2603"}],
                    message_count=2 * k + 1, prompt_len=3, fragment_ids=array("i", [7, 8, i]), max_new_tokens=16,
                    created_at=1e-7 * i + 1.5, first_token_at=1e16 if i % 4 == 1 else None, finished_at=3.25)
        step.output_ids, step.output_logprobs = array("i", [11, i]), array("f", [-0.25, -1e-8 * i])
        step.output_versions, step.status, step.in_segment = array("q", [4, 5]), "completed", True
        if i % 5 == 2:
            step.discarded = [{"output_ids": [1], "logprobs": [float("-inf"), 1e-300]}]
            step.routed_experts, step.routed_experts_chunks = "AAAA", ["A", "B"]
        if i % 7 == 3 and k == 1:
            step.fragment_mask, step.rebuilt_spans = array("b", [0, 1, 1]), [(1, 3)]
            step.fragment_logprobs, step.fragment_versions = array("f", [0.0, -0.5, -0.75]), array("q", [-1, 2, 2])
        steps.append(step)
    metadata: dict[str, Any] = {"n": i, "big": 2**40, "tiny": 5e-324, "text": "\u00e9\x01\"\\"} if i % 2 else {}
    segment = build_segment(steps, session_id=f"v{i:02d}", instance_id=steps[0].instance_id, rollout_id=f"v{i:02d}",
                            segment_index=0, start_reason="session_start", boundary_reason="finalize",
                            reward=[None, 0.5, -1e-5, 3][i % 4], metadata=metadata)
    return segment, steps


def test_a_durable_drain_decodes_one_row_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: a SQLite drain decoded every segment and step row before encoding the first, so a drain of
    4,000 turns held them all as Python objects at once (and that peak set the process's RSS for good).
    Now each row is decoded as it is encoded; the reply's bytes are those of the decoded read."""
    alive: dict[str, list[weakref.ref[Any]]] = {"segments": [], "steps": []}
    most = {"segments": 0, "steps": 0}

    def watching(kind: str, encode: Any) -> Any:
        def watched(record: Any) -> Any:
            alive[kind] = [ref for ref in alive[kind] if ref() is not None] + [weakref.ref(record)]
            most[kind] = max(most[kind], len(alive[kind]))
            return encode(record)
        return watched

    monkeypatch.setattr(store_messages, "segment_json", watching("segments", store_messages.segment_json))
    monkeypatch.setattr(store_messages, "stored_step_json", watching("steps", store_messages.stored_step_json))
    store = SQLiteStore(str(tmp_path), synchronous="OFF")
    memory = MemoryStore()
    for i in range(60):
        segment, steps = _varied(i)
        for backend in (store, memory):
            backend.put(f"v{i:02d}", (segment,), tuple(steps))
    store.commit()
    query = ReadQuery(drain=True, include_steps=True)
    whole = store.read(ReadQuery(include_steps=True), store_messages.keep)
    assert isinstance(whole.data, list) and isinstance(whole.steps, list)  # in process: the records, in lists
    assert len(whole.data) == 60 and len(whole.steps) == 120
    expected = store_messages.encode_body(whole)
    assert expected == memory.read(ReadQuery(include_steps=True), store_messages.encode_body)
    del whole
    most.update(segments=0, steps=0)
    parts = store.read(query, store_messages.encode_parts)
    assert b"".join(parts) == expected
    assert most == {"segments": 1, "steps": 1}  # all 60 and 120 before
    assert store.stats()["segments"] == store.stats()["steps"] == 0
    store.close()


def test_rows_decoded_one_by_one_are_escaped_whole_when_one_holds_a_lone_surrogate() -> None:
    """The fallback for text that is not valid Unicode encodes the whole body again: the rows are read again."""
    segments = [_segment(0, 3), attrs.evolve(_segment(1, 3), metadata={"name": "x\udc80"}), _segment(2, 3)]
    decoded: list[int] = []
    found = StoredRead(Rows([0, 1, 2], lambda i: decoded.append(i) or segments[i]))
    parts = store_messages.encode_parts(found)
    assert b"".join(parts) == store_messages.encode_body(ReadResult(segments)) and b"\\udc80" in parts[-1]
    assert decoded == [0, 1, 0, 1, 2]


def test_one_process_per_data_dir(tmp_path: Path) -> None:
    from actorproxy.errors import StartupError
    from actorproxy.store.sqlite import SQLiteStore

    first = SQLiteStore(str(tmp_path))
    with pytest.raises(StartupError, match="--data-dir: .* is in use by another actorproxy process"):
        SQLiteStore(str(tmp_path))
    first.close()
    SQLiteStore(str(tmp_path)).close()
