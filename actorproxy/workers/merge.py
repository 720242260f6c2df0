"""Merging the answers of every worker into one: JSON by a few rules, Prometheus text by a ``worker`` label.

JSON (``/trajectory/read``, ``/trajectory/stats``, ``/health``, ``/v1/rollout/*``, ``/sessions``,
``/ui/api/overview``): objects are merged key by key, lists are concatenated (worker 0's
items first), counts are summed (of the pause and resume counts, the largest). What every
worker must agree on (a setting, the epoch, the weight version) is kept when they agree and
becomes the list of the workers' values when they do not: a disagreement shows, it is never
averaged away. ``status`` is ``degraded`` when any worker is.

``/trajectory/read`` is spliced instead (:func:`read_parts`): each worker's ``data`` and ``steps`` arrays are
found by one scan of its answer (msgspec ``Raw``) and their contents joined as bytes, worker 0's first,
as the JSON merge would order them: no answer is decoded into objects (a drain of the whole store is
hundreds of MB as objects, eight times its JSON), merged, and encoded again.

Metrics: each worker's samples get a ``worker="<i>"`` label (aggregate with ``sum by``);
each metric's ``# HELP`` and ``# TYPE`` lines appear once, before all of its samples.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: Numbers every worker has the same of: kept when equal, listed when not (never summed).
SAME = frozenset({
    "epoch", "max_tokens", "max_bytes", "max_sessions", "context_window", "limit",
    "vocab_size", "port", "max_model_len",
})
#: Counts of fanned-out calls each worker has seen: a worker started later has seen fewer (the largest is kept).
LARGEST = frozenset({"pauses", "resumes", "now", "last_pause_seconds"})
#: Objects whose every number is a setting (``/health``'s ``config``).
SAME_TREES = frozenset({"config"})


def merge_json(answers: list[Any], key: str = "", same: bool = False) -> Any:
    """One value from each worker's (see the module doc)."""
    first = answers[0]
    if all(isinstance(a, dict) for a in answers):
        keys: dict[str, None] = {}
        for answer in answers:
            keys.update(dict.fromkeys(answer))
        inner_same = same or key in SAME_TREES
        merged = {}
        for k in keys:
            values = [a[k] for a in answers if k in a]
            merged[k] = merge_json(values, k, inner_same)
        return merged
    if all(isinstance(a, list) for a in answers):
        return [item for answer in answers for item in answer]
    numbers = all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in answers)
    if numbers and key in LARGEST:
        return max(answers)
    if numbers and not same and key not in SAME:
        return sum(answers)
    if all(a == first for a in answers):
        return first
    if key == "status" and "degraded" in answers:
        return "degraded"
    if all(isinstance(a, bool) for a in answers) and key in ("full", "resumed", "failed"):
        return any(answers)
    return answers


def merge_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dashboard's per-second samples of every worker as one per second: counts summed, latency the worst."""
    by_second: dict[Any, dict[str, Any]] = {}
    for sample in history:
        into = by_second.get(sample["t"])
        if into is None:
            by_second[sample["t"]] = dict(sample)
            continue
        for key, value in sample.items():
            if key in ("p50_ms", "p99_ms"):
                into[key] = max((v for v in (into[key], value) if v is not None), default=None)
            elif key != "t" and isinstance(value, (int, float)):
                into[key] = into.get(key, 0) + value
    return [by_second[t] for t in sorted(by_second)]


def merge_metrics(texts: list[str]) -> str:
    """Prometheus text of every worker, each sample labelled with its worker."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for index, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    comments, _ = families.setdefault(family, ([], []))
                    if index == 0:
                        comments.append(line)
                continue
            name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
            name = line[:name_end]
            if not (family and name.startswith(family)):
                family = name
            label = f'worker="{index}"'
            if line[name_end:name_end + 1] == "{":
                closing = line[name_end + 1:name_end + 2] == "}"
                sample = f"{name}{{{label}{'' if closing else ','}{line[name_end + 1:]}"
            else:
                sample = f"{name}{{{label}}}{line[name_end:]}"
            families.setdefault(family, ([], []))[1].append(sample)
    lines = []
    for comments, samples in families.values():
        lines += comments + samples
    return "\n".join(lines) + "\n"


#: The keys of a ``/trajectory/read`` answer (``runtime/store_messages.py: encode_parts``), in their order.
_READ_KEYS = ("data", "steps")
_READ_ANSWER = dict[str, msgspec.Raw]


def read_parts(bodies: list[bytes]) -> list[bytes]:
    """The workers' ``/trajectory/read`` answers as one answer, in parts, but for its closing ``}`` (see the module
    doc): ``{"data":[...]`` with every worker's segments, then ``,"steps":[...]`` when they were asked for.

    Raises ``ValueError`` for an answer that is not such an object (its arrays and nothing else)."""
    if not bodies:
        raise ValueError("no answer to splice")
    arrays: dict[str, list[bytes]] = {}
    for body in bodies:
        try:
            answer = msgspec.json.decode(body, type=_READ_ANSWER)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not a read's answer: {exc}") from exc
        if "data" not in answer:
            raise ValueError("not a read's answer: no 'data'")
        for key, raw in answer.items():
            view = memoryview(raw)  # (where it lies in the answer: no copy yet)
            if key not in _READ_KEYS or view[:1].tobytes() != b"[" or view[-1:].tobytes() != b"]":
                raise ValueError(f"not a read's answer: {key!r}")
            contents = arrays.setdefault(key, [])
            inner = bytes(view[1:-1])
            if inner and not inner.isspace():
                contents.append(inner)
    parts: list[bytes] = []
    for key in _READ_KEYS:
        if key in arrays:
            parts.append(b'{"data":[' if key == "data" else b',"' + key.encode() + b'":[')
            for i, inner in enumerate(arrays[key]):
                if i:
                    parts.append(b",")
                parts.append(inner)
            parts.append(b"]")
    return parts
