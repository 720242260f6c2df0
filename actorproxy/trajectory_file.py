"""``proxy_trajectory.json``: one finalized session as a file, for trainers that read files.

With ``--trajectory-dir DIR`` every finalize writes ``DIR/<session>/proxy_trajectory.json``
(the session id percent-encoded into one path component). The file holds the
session's segments exactly as ``POST /trajectory/read`` returns them (ids,
masks, logprobs, versions, boundary reasons) and a summary of each step
without its arrays. It is written to a temporary file in the same directory
and renamed over the old one, so a reader never sees half a file.

Schema (``"schema": "actorproxy.proxy_trajectory/1"``)::

    {"schema": ..., "session_id": str, "written_at": float (Unix time),
     "segments": [Segment, ...],   # docs/data.md, child sessions (sub-agents) included
     "steps": [StepSummary, ...],  # a step without output_ids/logprobs/concat_* arrays
     "messages_snapshot": [message, ...] | None,  # the main conversation as the model last saw it, last reply included
     "trajectory_segments": [{trajectory_id, segment_index, num_tokens, ..., boundary_reason}, ...]}

``messages_snapshot`` is the key LiveRL's dashboard reads (``webui/server.py``).

Load one with :func:`load_trajectory_file` (also exported by ``actorproxy.client``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from .session_meta import main_steps, messages_snapshot, segment_index

SCHEMA = "actorproxy.proxy_trajectory/1"
FILE_NAME = "proxy_trajectory.json"

#: Step fields left out of a summary: the arrays (they are in the segments) and bulky payloads.
_HEAVY = frozenset(
    {
        "output_ids",
        "output_logprobs",
        "concat_token_ids",
        "concat_response_logprobs",
        "concat_response_mask",
        "concat_versions",
        "routed_experts",
        "routed_experts_chunks",
        "discarded",
        "new_messages",
    }
)


def trajectory_path(directory: str | os.PathLike[str], session_id: str) -> Path:
    """Where the file of ``session_id`` goes (``/`` and other specials are percent-encoded)."""
    return Path(directory) / urllib.parse.quote(session_id, safe="") / FILE_NAME


def build_document(session_id: str, read_result: dict[str, Any]) -> dict[str, Any]:
    """The file's content from a ``/trajectory/read`` result with ``include_steps``."""
    steps = [{k: v for k, v in step.items() if k not in _HEAVY} for step in read_result.get("steps", [])]
    return {
        "schema": SCHEMA,
        "session_id": session_id,
        "written_at": time.time(),
        "segments": read_result.get("data", []),
        "steps": steps,
        "messages_snapshot": messages_snapshot(main_steps(read_result, session_id), session_id),
        "trajectory_segments": segment_index(read_result.get("data", [])),
    }


def write_trajectory_file(directory: str | os.PathLike[str], session_id: str, read_result: dict[str, Any]) -> Path:
    """Write (atomically) and return the path of ``session_id``'s trajectory file. Blocking I/O."""
    path = trajectory_path(directory, session_id)
    write_document(path, build_document(session_id, read_result))
    return path


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as JSON at ``path`` through a temporary file renamed over it. Blocking I/O."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(document, separators=(",", ":")).encode()
    fd, tmp = tempfile.mkstemp(prefix=".proxy_trajectory.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_trajectory_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``proxy_trajectory.json`` (a file, or the session's directory) and check its schema."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    document = json.loads(path.read_bytes())
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not an actorproxy trajectory file (schema {SCHEMA})")
    return document
