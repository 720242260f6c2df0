"""Sans-IO helpers every engine's stream parser shares: weight-version spans, token deltas."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from .base import GenerationEvent, TokenDelta, WeightVersionSpan

#: The version label when an engine reports none (SGLang's own default name).
DEFAULT_VERSION = "default"


def parse_spans(raw: object) -> tuple[WeightVersionSpan, ...]:
    """``[{"version", "start", "end"}]`` (or ``[version, start, end]`` triples) as spans."""
    spans: list[WeightVersionSpan] = []
    if not isinstance(raw, list):
        return ()
    for item in raw:
        if isinstance(item, Mapping):
            version, start, end = item.get("version"), item.get("start"), item.get("end")
        elif isinstance(item, list | tuple) and len(item) == 3:
            version, start, end = item
        else:
            continue
        if isinstance(start, int) and isinstance(end, int) and version is not None:
            spans.append(WeightVersionSpan(str(version), start, end))
    return tuple(spans)


def version_at(spans: tuple[WeightVersionSpan, ...], index: int) -> str | None:
    for span in spans:
        if span.start <= index < span.end:
            return span.version
    return None


def token_deltas(ids: list[int], logprobs: list[float], versions: list[str]) -> list[GenerationEvent]:
    """One :class:`TokenDelta` per run of tokens sampled by the same version."""
    events: list[GenerationEvent] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or versions[i] != versions[start]:
            events.append(TokenDelta(tuple(ids[start:i]), tuple(logprobs[start:i]), versions[start]))
            start = i
    return events


def take_merged(pending: deque[GenerationEvent]) -> GenerationEvent:
    """The next event, with the token deltas right behind it (same version) merged in.

    A proxy behind its engine reads many events at once (after a pause's abort, the
    backlog the engine streamed before it stopped): handing them on as one delta costs
    one record, one parse, one frame to the agent instead of one each. An engine may
    send several tokens per event anyway, so nothing downstream can tell.
    """
    event = pending.popleft()
    if type(event) is not TokenDelta or not pending:
        return event
    ids, logprobs = list(event.token_ids), list(event.logprobs)
    while pending and type(nxt := pending[0]) is TokenDelta and nxt.weight_version == event.weight_version:
        pending.popleft()
        ids += nxt.token_ids
        logprobs += nxt.logprobs
    if len(ids) == len(event.token_ids):
        return event
    return TokenDelta(tuple(ids), tuple(logprobs), event.weight_version)
