"""The SQLite store (the default): segments, retired steps and the open sessions' journal in one file.

Stdlib ``sqlite3`` in WAL mode with ``synchronous=FULL``: a commit survives a
crash of the process and of the machine. The store actor calls it from one
worker thread at a time and batches writes between commits. A drain reads,
serialises and deletes in one transaction; nothing is deleted unless the
serialised answer exists.

Tables: ``segments`` (fields as JSON, the four arrays as bytes), ``steps``
(fields as JSON, the arrays packed in one blob), ``journal`` (the completed
steps of open sessions, same encoding), ``sessions`` (sub-agent children) and
``state`` (the counters and the number of commits).

Beside the file, ``committed.json`` holds what the file held after its latest
commit (the number of commits, finalized sessions, segments and steps stored),
written once the commit is durable. A start that finds the file behind it (its
WAL deleted after a crash, an older copy restored) says so at CRITICAL, with how
much is lost, instead of serving on without a word. A file SQLite cannot open is
a :class:`StartupError` naming ``--data-dir``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..core.records import Segment, Step
from ..errors import StartupError
from ..schema.records import StoredRead, StoredStep
from .base import Found, Held, HeldDrains, ReadQuery, Recovered, StoreCounters, Usage, session_key, step_tokens
from .codec import (
    Rows,
    decode_segment,
    decode_step,
    dumps,
    journal_meta,
    recovered_segment,
    segment_blobs,
    segment_meta,
    step_blob,
    step_meta,
    stored_step,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

DB_FILE = "trajectories.sqlite3"
#: What the file held after its latest commit (see the module docstring).
MARK_FILE = "committed.json"
_MARK_SIZE = 256
#: Space held for the trainer's way out: given up when a drain finds the disk full (see :meth:`SQLiteStore.read`).
RESERVE_FILE = "reserve"
#: The reserve's size: this, or an eighth of the free space when that is less.
RESERVE_BYTES = 8 * 1024 * 1024
#: A drain leaving a WAL this large checkpoints and truncates it (so does one that took the reserve).
WAL_TRUNCATE_BYTES = 64 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (key TEXT PRIMARY KEY, children TEXT NOT NULL DEFAULT '[]');
CREATE TABLE IF NOT EXISTS segments (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, session_id TEXT NOT NULL,
    trajectory_id TEXT NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL, meta TEXT NOT NULL,
    token_ids BLOB NOT NULL, loss_mask BLOB NOT NULL, logprobs BLOB NOT NULL, versions BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS segments_key ON segments (key);
CREATE INDEX IF NOT EXISTS segments_trajectory ON segments (trajectory_id);
CREATE TABLE IF NOT EXISTS steps (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, session_id TEXT NOT NULL,
    step_index INTEGER NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL, meta TEXT NOT NULL,
    arrays BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS steps_key ON steps (key);
CREATE TABLE IF NOT EXISTS journal (
    session_id TEXT NOT NULL, step_index INTEGER NOT NULL, key TEXT NOT NULL,
    segment_index INTEGER NOT NULL, closed INTEGER NOT NULL DEFAULT 0, meta TEXT NOT NULL,
    arrays BLOB NOT NULL, PRIMARY KEY (session_id, step_index));
CREATE TABLE IF NOT EXISTS state (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_SEGMENT_COLS = "seq, session_id, tokens, bytes, meta, token_ids, loss_mask, logprobs, versions"
_STEP_COLS = "seq, session_id, tokens, bytes, meta, arrays"


class SQLiteStore(HeldDrains):
    """Segments and steps in ``<data_dir>/trajectories.sqlite3``; only counters are kept in memory."""

    blocking = True
    journals = True
    name = "sqlite"

    def __init__(self, data_dir: str, *, synchronous: str = "FULL", reserve_bytes: int = RESERVE_BYTES) -> None:
        os.makedirs(data_dir, exist_ok=True)
        self.path = os.path.join(data_dir, DB_FILE)
        self._reserve = os.path.join(data_dir, RESERVE_FILE)
        self._reserve_bytes = reserve_bytes
        # One process per directory: a second one would recover (take) the first one's journal.
        self._lock = open(os.path.join(data_dir, "LOCK"), "a")  # noqa: SIM115 (held until close())
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StartupError("--data-dir", f"{data_dir} is in use by another actorproxy process; give each "
                               "one its own --data-dir") from None
        self._tokens = 0
        self._bytes = 0
        self._commits = 0
        #: The rows drains hold while their replies are sent (:meth:`hold`), by table: their ``seq``.
        self._held_segments: set[int] = set()
        self._held_steps: set[int] = set()
        self._mark = -1
        #: What committed data the file no longer held at start (see the module docstring).
        self.lost_at_start: dict[str, int] = {}
        try:
            self._open(synchronous)
        except (sqlite3.Error, ValueError) as exc:
            self._lock.close()
            raise StartupError("--data-dir", f"{self.path} cannot be opened as a store ({exc}): it may be damaged; "
                               "move it aside (keep it for recovery) or give another --data-dir") from None
        self._in_tx = False
        self._saved: tuple[int, int, dict[str, Any]] = (0, 0, {})
        self._check_mark(data_dir)
        self._make_reserve()

    def _open(self, synchronous: str) -> None:
        # One connection, used by one worker thread at a time (the store actor's limiter).
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM state WHERE name = 'counters'").fetchone()
            self._counts = StoreCounters(json.loads(row[0]) if row else None)
            row = self._db.execute("SELECT value FROM state WHERE name = 'commits'").fetchone()
            self._commits = int(row[0]) if row else 0
            for table in ("segments", "steps"):
                tokens, size = self._db.execute(
                    f"SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(bytes), 0) FROM {table}").fetchone()
                self._tokens += tokens
                self._bytes += size
        except BaseException:
            self._db.close()
            raise

    # -- the reserve: room for a drain on a full disk ---------------------------------

    def _make_reserve(self) -> bool:
        """Hold room for a drain (best effort): ``reserve_bytes``, or an eighth of the free space if less."""
        if os.path.exists(self._reserve):
            return True
        stat = os.statvfs(os.path.dirname(self._reserve))
        size = min(self._reserve_bytes, stat.f_bavail * stat.f_frsize // 8)
        if size <= 0:
            return False
        partial = self._reserve + ".new"
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            os.replace(partial, self._reserve)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            log.warning("store %s: no room for its %d-byte reserve (%s); a drain on a full disk may fail",
                        self.path, size, exc)
            return False
        return True

    def _release_reserve(self) -> bool:
        """Give the reserve's room to the database (the disk is full); False if there is none."""
        try:
            size = os.path.getsize(self._reserve)
            os.unlink(self._reserve)
        except FileNotFoundError:
            return False
        log.warning("store %s: the disk is full; its %d-byte reserve is released so that a drain can run (and "
                    "free space); it is made again once there is room", self.path, size)
        return True

    def _after_drain(self) -> None:
        """With the reserve given up (or a large WAL): the WAL checkpointed and truncated, the reserve made again.

        So the room the drained rows took goes back to the file system. Not after every
        drain: a trainer draining session by session would pay a checkpoint each time.
        """
        try:
            wal = os.path.getsize(self.path + "-wal")
        except OSError:
            wal = 0
        if os.path.exists(self._reserve) and wal < WAL_TRUNCATE_BYTES:
            return
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("store %s: the WAL could not be checkpointed after a drain (%s)", self.path, exc)
        self._make_reserve()

    # -- what the file held after its latest commit ---------------------------------

    def _held(self) -> dict[str, int]:
        counters = self._counts.counters
        return {"commits": self._commits, "finalized_sessions": self._counts.closed_by["finalize"],
                "segments": counters["segments_stored"], "steps": counters["steps_stored"]}

    def _check_mark(self, data_dir: str) -> None:
        """Compare the file with ``committed.json``: report loudly what it lost, then mark what it holds."""
        mark_path = os.path.join(data_dir, MARK_FILE)
        self._mark = os.open(mark_path, os.O_RDWR | os.O_CREAT, 0o644)
        raw = os.pread(self._mark, _MARK_SIZE, 0)
        held = self._held()
        try:
            marked = {k: int(v) for k, v in json.loads(raw).items()} if raw.strip() else None
        except (ValueError, TypeError, AttributeError):
            log.warning("%s is unreadable (%r); it is written anew", mark_path, raw[:60])
            marked = None
        if marked is not None and marked.get("commits", 0) > held["commits"]:
            self.lost_at_start = {k: max(0, marked.get(k, 0) - v) for k, v in held.items()}
            lost = self.lost_at_start
            log.critical(
                "store %s: %d finalized session(s), %d segment(s) and %d step(s) committed before (%d commit(s)) "
                "are not in the file: its WAL (%s-wal) was deleted after a crash, or an older copy was restored. "
                "They are lost unless that WAL or a newer copy is put back (stop first); counted in "
                "/trajectory/stats lost_at_start", self.path, lost["finalized_sessions"], lost["segments"],
                lost["steps"], lost["commits"], self.path)
        self._write_mark()

    def _write_mark(self) -> None:
        data = json.dumps(self._held()).encode()
        os.pwrite(self._mark, data.ljust(_MARK_SIZE - 1) + b"\n", 0)

    # -- writes ------------------------------------------------------------------

    def _begin(self) -> None:
        if not self._in_tx:
            self._saved = (self._tokens, self._bytes, self._counts.to_json())
            self._db.execute("BEGIN IMMEDIATE")
            self._in_tx = True

    def commit(self) -> None:
        if self._in_tx:
            self._db.execute(
                "INSERT OR REPLACE INTO state (name, value) VALUES ('counters', ?)", (dumps(self._counts.to_json()),)
            )
            self._db.execute("INSERT OR REPLACE INTO state (name, value) VALUES ('commits', ?)",
                             (str(self._commits + 1),))
            self._db.execute("COMMIT")
            self._commits += 1
            self._in_tx = False
            self._write_mark()  # after the commit is durable: the mark is never ahead of the file

    def rollback(self) -> None:
        """Undo the open transaction and the counters it moved (after a failed write or commit)."""
        if self._in_tx:
            self._in_tx = False
            self._tokens, self._bytes, saved = self._saved
            self._counts = StoreCounters(saved)
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:  # a failed COMMIT may have rolled back already
                pass

    def _ensure_session(self, session_id: str) -> str:
        key = session_key(session_id)
        row = self._db.execute("SELECT children FROM sessions WHERE key = ?", (key,)).fetchone()
        if row is None:
            children: list[str] = []
            self._db.execute("INSERT INTO sessions (key, children) VALUES (?, '[]')", (key,))
        else:
            children = json.loads(row[0])
        if key != session_id and session_id not in children:
            children.append(session_id)
            self._db.execute("UPDATE sessions SET children = ? WHERE key = ?", (dumps(children), key))
            self._counts.counters["sub_agent_sessions"] += 1
        return key

    def put(self, session_id: str, segments: tuple[Segment, ...], steps: tuple[Step, ...]) -> None:
        self._begin()
        key = self._ensure_session(session_id)
        for seg in segments:
            meta = dumps(segment_meta(seg))
            size = 13 * seg.num_tokens + len(meta)
            self._db.execute(
                "INSERT INTO segments (key, session_id, trajectory_id, tokens, bytes, meta, token_ids, loss_mask,"
                " logprobs, versions) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key, seg.trajectory_id.rpartition("#")[0], seg.trajectory_id, seg.num_tokens, size, meta,
                 *segment_blobs(seg)),
            )
            self._tokens += seg.num_tokens
            self._bytes += size
            self._db.execute(
                f"UPDATE journal SET closed = 1 WHERE session_id = ? AND step_index IN ({_marks(seg.step_indices)})",
                (seg.trajectory_id.rpartition("#")[0], *seg.step_indices),
            )
        for step in steps:
            self._insert_step(key, step.session_id, step.index, step_tokens(step), dumps(step_meta(step)),
                              step_blob(step))
        if steps:
            indexes = [s.index for s in steps]
            self._db.execute(
                f"DELETE FROM journal WHERE session_id = ? AND step_index IN ({_marks(indexes)})",
                (session_id, *indexes),
            )
        self._counts.count_put(session_id, segments, steps)

    def _insert_step(self, key: str, session_id: str, index: int, tokens: int, meta: str, blob: bytes) -> None:
        size = len(meta) + len(blob)
        self._db.execute(
            "INSERT INTO steps (key, session_id, step_index, tokens, bytes, meta, arrays) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key, session_id, index, tokens, size, meta, blob),
        )
        self._tokens += tokens
        self._bytes += size

    def journal(self, session_id: str, step: Step) -> None:
        self._begin()
        self._db.execute(
            "INSERT OR REPLACE INTO journal (session_id, step_index, key, segment_index, meta, arrays)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (session_id, step.index, session_key(session_id), step.segment_index, journal_meta(step), step_blob(step)),
        )
        if step.retry_of is not None:  # the retried step left the segment
            row = self._db.execute(
                "SELECT meta FROM journal WHERE session_id = ? AND step_index = ?", (session_id, step.retry_of)
            ).fetchone()
            if row is not None:
                meta = json.loads(row[0])
                meta.update(status="superseded", in_segment=False, superseded_by=step.index)
                self._db.execute(
                    "UPDATE journal SET meta = ? WHERE session_id = ? AND step_index = ?",
                    (dumps(meta), session_id, step.retry_of),
                )

    # -- reads -------------------------------------------------------------------

    def _hold(self, held: Held, holding: bool) -> None:
        segments, steps = (r[0] for r in held.segments), (r[0] for r in held.steps)
        if holding:
            self._held_segments.update(segments)
            self._held_steps.update(steps)
        else:
            self._held_segments.difference_update(segments)
            self._held_steps.difference_update(steps)

    def _read(self, query: ReadQuery, finish: Callable[[Found], T]) -> tuple[T, Held]:
        """``finish`` of what ``query`` reads, and what a drain of it deletes (nothing another drain holds)."""
        db = self._db
        only: str | None = None
        where, args = "", ()  # type: tuple[str, tuple[Any, ...]]
        if query.session_id is not None:
            key = session_key(query.session_id)
            row = db.execute("SELECT children FROM sessions WHERE key = ?", (key,)).fetchone()
            if row is None or (key != query.session_id and query.session_id not in json.loads(row[0])):
                raise query.missing()
            only = query.session_id if key != query.session_id else None
            where, args = ("WHERE key = ? AND session_id = ?", (key, only)) if only else ("WHERE key = ?", (key,))
            seg_rows = db.execute(f"SELECT {_SEGMENT_COLS} FROM segments {where} ORDER BY seq", args).fetchall()
        elif query.trajectory_id is not None:
            key = session_key(query.trajectory_id.rpartition("#")[0])
            seg_rows = db.execute(
                f"SELECT {_SEGMENT_COLS} FROM segments WHERE key = ? AND trajectory_id = ? ORDER BY seq",
                (key, query.trajectory_id),
            ).fetchall()
            if not seg_rows:
                raise query.missing()
            where, args = "WHERE key = ?", (key,)
        else:
            seg_rows = db.execute(f"SELECT {_SEGMENT_COLS} FROM segments ORDER BY key, seq").fetchall()
        step_rows: list[Any] = []
        whole = query.trajectory_id is None and only is None
        if query.include_steps or (query.drain and (whole or only)):
            step_rows = db.execute(f"SELECT {_STEP_COLS} FROM steps {where} ORDER BY key, seq", args).fetchall()
        if query.drain and (self._held_segments or self._held_steps):  # another drain delivers those
            seg_rows = [r for r in seg_rows if r[0] not in self._held_segments]
            step_rows = [r for r in step_rows if r[0] not in self._held_steps]
        # Each row is decoded as ``finish`` takes it: encoded, one segment or step is alive at a time.
        found = StoredRead(Rows(seg_rows, _segment), Rows(step_rows, _step) if query.include_steps else None)
        done = finish(found)  # serialise first: a failure here deletes nothing
        return done, Held(query, only, seg_rows, step_rows if (whole or only) else [])

    def _drain(self, held: Held) -> None:
        try:
            self._delete_held(held)
        except sqlite3.OperationalError as exc:
            # A full disk: the deletes need room in the WAL. The reserve is that room.
            if not disk_full(exc) or not self._release_reserve():
                raise
            self._delete_held(held)
        self._after_drain()

    def _delete_held(self, held: Held) -> None:
        query, only = held.query, held.only
        self._begin()
        try:
            self._delete("segments", held.segments)
            self._delete("steps", held.steps)
            if query.trajectory_id is None:
                # A session goes once nothing of it is left: not what came since it was read, nor what another
                # drain holds.
                left = "NOT EXISTS (SELECT 1 FROM segments s WHERE s.key = sessions.key) AND NOT EXISTS " \
                       "(SELECT 1 FROM steps t WHERE t.key = sessions.key)"
                if query.session_id is None:
                    self._db.execute(f"DELETE FROM sessions WHERE {left}")
                elif only is None:
                    self._db.execute(f"DELETE FROM sessions WHERE key = ? AND {left}", (query.session_id,))
                else:
                    key = session_key(only)
                    (children,) = self._db.execute("SELECT children FROM sessions WHERE key = ?", (key,)).fetchone()
                    kept = [c for c in json.loads(children) if c != only]
                    self._db.execute("UPDATE sessions SET children = ? WHERE key = ?", (dumps(kept), key))
            self._counts.counters["segments_drained"] += len(held.segments)
            self.commit()
        except BaseException:
            self.rollback()
            raise

    def _delete(self, table: str, rows: list[Any]) -> None:
        """Delete ``rows`` (their ``seq``), counting only those still there (``--store ray`` may have sent one on)."""
        seqs = [r[0] for r in rows]
        for start in range(0, len(seqs), 500):
            chunk = seqs[start : start + 500]
            marks = _marks(chunk)
            tokens, size = self._db.execute(
                f"SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(bytes), 0) FROM {table} WHERE seq IN ({marks})", chunk
            ).fetchone()
            self._db.execute(f"DELETE FROM {table} WHERE seq IN ({marks})", chunk)
            self._tokens -= tokens
            self._bytes -= size

    def knows(self, session_id: str) -> bool:
        key = session_key(session_id)
        return self._db.execute("SELECT 1 FROM sessions WHERE key = ?", (key,)).fetchone() is not None

    def usage(self) -> Usage:
        return Usage(self._tokens, self._bytes)

    def stats(self) -> dict[str, Any]:
        def count(sql: str) -> int:
            return int(self._db.execute(sql).fetchone()[0])

        return {
            "store": self.name,
            "sessions": count("SELECT COUNT(*) FROM sessions"),
            "segments": count("SELECT COUNT(*) FROM segments"),
            "steps": count("SELECT COUNT(*) FROM steps"),
            "tokens": self._tokens,
            "bytes": self._bytes,
            "journal_steps": count("SELECT COUNT(*) FROM journal"),
            **self._counts.stats(),
            **({"lost_at_start": dict(self.lost_at_start)} if self.lost_at_start else {}),
        }

    # -- recovery ------------------------------------------------------------------

    def recover(self) -> Recovered:
        """Turn the journal of sessions a crash left open into steps and ``recovered`` segments.

        Steps of a segment that was already committed (closed by a boundary) are
        kept as steps only; the rest of each session's steps are rebuilt into its
        open segment. Returns each such session's next step and segment index.
        """
        try:
            return self._recover()
        except sqlite3.DatabaseError as exc:
            self.rollback()
            raise StartupError("--data-dir", f"{self.path}: its journal cannot be recovered ({exc}): it may be "
                               "damaged; move it aside (keep it for recovery) or give another --data-dir") from None

    def _recover(self) -> Recovered:
        nexts = self._stored_numbering()
        rows = self._db.execute(
            "SELECT session_id, key, segment_index, closed, meta, arrays FROM journal ORDER BY session_id, step_index"
        ).fetchall()
        if not rows:
            return nexts
        by_session: dict[str, list[Any]] = {}
        for row in rows:
            by_session.setdefault(row[0], []).append(row)
        self._begin()
        for session_id, entries in by_session.items():
            metas = [json.loads(r[4]) for r in entries]
            steps = [decode_step(meta, r[5]) for meta, r in zip(metas, entries, strict=True)]
            # Completed steps of segments not committed; not ``in_segment``: a step is journaled whenever the
            # writer gets to it, so one that a rebuild took out later may say either (recovered_segment decides).
            open_steps = [s for s, r in zip(steps, entries, strict=True) if not r[3] and s.status == "completed"]
            segments: list[Segment] = []
            replaced: set[int] = set()
            for index in sorted({s.segment_index for s in open_steps}):
                members = [s for s in open_steps if s.segment_index == index]
                segment, gone = recovered_segment(session_id, entries[0][1], members)
                segments.append(segment)
                replaced.update(s.index for s in gone)
            key = self._ensure_session(session_id)
            for seg in segments:
                self.put(session_id, (seg,), ())
            for step, meta, entry in zip(steps, metas, entries, strict=True):
                if step.index in replaced:  # a rebuild (recompute mode) took it out of its segment
                    meta["in_segment"] = False
                self._insert_step(key, session_id, step.index, step_tokens(step), dumps(meta), entry[5])
            self._counts.counters["steps_stored"] += len(steps)
            self._counts.counters["recovered_sessions"] += 1
            self._counts.counters["recovered_segments"] += len(segments)
            self._counts.counters["recovered_steps"] += len(steps)
            next_step, next_segment = nexts.pop(session_id, (0, 0))  # (put last: the newest)
            nexts[session_id] = (max(next_step, max(s.index for s in steps) + 1),
                                 max(next_segment, max(s.segment_index for s in steps) + 1))
        self._db.execute("DELETE FROM journal")
        self.commit()
        log.warning("recovered %d open session(s) with %d journaled step(s) after an unclean stop",
                    len(by_session), len(rows))
        return nexts

    def _stored_numbering(self) -> Recovered:
        """Per session in the store: the next step and segment index (a returning session never reuses an id).

        Oldest first, by what was stored last of each (steps, then segments): the registry keeps the newest
        when there are more than it remembers.
        """
        nexts: Recovered = {}
        for session_id, step in self._db.execute(
                "SELECT session_id, MAX(step_index) FROM steps GROUP BY session_id ORDER BY MAX(seq)"):
            nexts[session_id] = (int(step) + 1, 0)
        for (trajectory_id,) in self._db.execute("SELECT trajectory_id FROM segments ORDER BY seq"):
            session_id, _, index = trajectory_id.rpartition("#")
            if index.isdigit():
                step, segment = nexts.pop(session_id, (0, 0))
                nexts[session_id] = (step, max(segment, int(index) + 1))
        return nexts

    def close(self) -> None:
        self.commit()
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()
        os.close(self._mark)
        self._lock.close()


def _segment(row: Any) -> Segment:
    """A segment row (:data:`_SEGMENT_COLS`) read back."""
    return decode_segment(json.loads(row[4]), (row[5], row[6], row[7], row[8]))


def _step(row: Any) -> StoredStep:
    """A step row (:data:`_STEP_COLS`) read back."""
    return stored_step(json.loads(row[4]), row[5])


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's ``SQLITE_FULL`` (the disk, or the file's page limit, is full)."""
    return isinstance(exc, sqlite3.Error) and (
        getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "is full" in str(exc))


def _marks(values: Iterable[Any]) -> str:
    return ", ".join("?" for _ in values)
