"""Building a closed segment into its training sample, in each build mode (sans-IO).

* ``concat`` — the segment's exact ids: fragments and sampled ids back to back
  (:func:`~actorproxy.core.records.build_segment`).
* ``last_step`` — the last step's whole conversation rendered afresh, then the
  last step's sampled ids. Earlier replies of this segment are found in the
  rendering by the template's own offsets (:mod:`.spans`) and trained (mask 1)
  with placeholder logprobs of 0.0, listed in ``invalid_logprob_spans``.

:func:`rebuild_prefix` is shared with ``--on-history-rewrite recompute``, which
rebuilds a rewritten conversation in place and marks the replies in it the
same way. :func:`verify_segment` re-renders a segment's conversation and
reports where it differs from the recorded ids (``--verify-tito``).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..tokenization.tokenizer import ChatTokenizer
from .messages import echo_matches
from .records import (
    CONTEXT_VERSION,
    Segment,
    Step,
    build_segment,
    finish_segment,
    float_array,
    version_array,
    version_number,
)
from .spans import AssistantSpan, RenderedConversation, render_with_spans
from .tito import OpenSegment
from .verify import VerifyFailure, VerifyReport, verify_prompt


@attrs.frozen
class RebuiltPrefix:
    """A conversation rendered afresh, with this session's replies in it marked for training."""

    ids: array[int]
    #: 1 on the tokens of replies the policy generated (found by meaning among the given steps).
    mask: array[int]
    #: The producing step's weight version on those tokens, -1 elsewhere.
    versions: array[int]
    #: ``[start, end)`` token ranges of the marked replies.
    spans: list[tuple[int, int]]
    #: Assistant messages the policy did not generate (written by the agent): left at mask 0.
    foreign_replies: int


def step_version(step: Step) -> int:
    """The weight version a step's reply was sampled with (its newest)."""
    return max(step.output_versions) if step.output_versions else version_number(step.weight_version)


def policy_spans(
    rendered: RenderedConversation, messages: Sequence[Mapping[str, Any]], steps: Sequence[Step]
) -> tuple[list[tuple[AssistantSpan, Step]], int]:
    """Pair each assistant span with the step whose reply it echoes (by meaning, in order).

    Returns the pairs and how many assistant messages matched no step.
    """
    outputs = [s for s in steps if s.output is not None]
    pairs: list[tuple[AssistantSpan, Step]] = []
    foreign = 0
    at = 0
    for span in rendered.spans:
        message = messages[span.message_index]
        for k in range(at, len(outputs)):
            output = outputs[k].output
            assert output is not None
            if echo_matches(message, output):
                pairs.append((span, outputs[k]))
                at = k + 1
                break
        else:
            foreign += 1
    return pairs, foreign


def rebuild_prefix(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    enable_thinking: bool | None,
    steps: Sequence[Step],
) -> RebuiltPrefix:
    """Render ``messages`` with the generation prompt; mark the replies ``steps`` generated.

    Raises :class:`~actorproxy.core.spans.SpanError` when the template's assistant
    turns cannot be located, and whatever the template raises.
    """
    rendered = render_with_spans(
        tokenizer, messages, tools=tools or None, enable_thinking=enable_thinking, add_generation_prompt=True
    )
    n = len(rendered.ids)
    mask = array("b", bytes(n))
    versions = version_array([CONTEXT_VERSION]) * n
    pairs, foreign = policy_spans(rendered, messages, steps)
    spans: list[tuple[int, int]] = []
    for span, step in pairs:
        width = span.end - span.start
        mask[span.start : span.end] = array("b", b"\x01" * width)
        versions[span.start : span.end] = version_array([step_version(step)]) * width
        spans.append((span.start, span.end))
    return RebuiltPrefix(rendered.ids, mask, versions, spans, foreign)


@attrs.frozen
class SegmentIdentity:
    """Who a closed segment belongs to and why it opened and closed."""

    session_id: str
    parent_traj_id: str
    instance_id: str | None
    rollout_id: str
    boundary_reason: str
    reward: float | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)


#: The fields of a segment identity that :func:`build_segment` takes as they are (its metadata is built per segment).
_AS_THEY_ARE = tuple(field.name for field in attrs.fields(SegmentIdentity) if field.name != "metadata")


def assemble_segment(
    seg: OpenSegment,
    tokenizer: ChatTokenizer,
    who: SegmentIdentity,
    *,
    mode: str = "concat",
    verify: bool = False,
    mask_nonlast_version: bool = False,
) -> Segment:
    """The training sample of a closed segment in ``mode``, with verification if asked."""
    metadata: dict[str, Any] = dict(who.metadata)
    if seg.rebuilds:
        metadata["rebuilds"] = list(seg.rebuilds)
        metadata["rebuilt_steps"] = [s.index for s in seg.rebuilt_steps]
    if verify:
        metadata["verify"] = verify_segment(seg, tokenizer)
    common: dict[str, Any] = {name: getattr(who, name) for name in _AS_THEY_ARE}
    common.update(segment_index=seg.index, start_reason=seg.start_reason, mask_nonlast_version=mask_nonlast_version)
    if mode == "last_step":
        try:
            return _last_step(seg, tokenizer, metadata, common)
        except Exception as exc:  # a template may raise anything; the exact concat sample is still right
            metadata["last_step_failed"] = f"{type(exc).__name__}: {exc}"
    return build_segment(list(seg.steps), metadata=metadata, **common)


def _last_step(seg: OpenSegment, tokenizer: ChatTokenizer, metadata: dict[str, Any], common: dict[str, Any]) -> Segment:
    last = seg.steps[-1]
    request = seg.last_request
    if request is None:
        raise ValueError("the segment kept no request to re-render")
    prefix = rebuild_prefix(
        tokenizer,
        request.messages,
        tools=request.tools,
        enable_thinking=request.enable_thinking,
        steps=[*seg.rebuilt_steps, *seg.steps[:-1]],
    )
    out = len(last.output_ids)
    token_ids = prefix.ids + last.output_ids
    loss_mask = prefix.mask + array("b", b"\x01" * out)
    logprobs = float_array(bytes(4 * len(prefix.ids))) + last.output_logprobs
    versions = prefix.versions + last.output_versions
    metadata.update(
        build_mode="last_step",
        recomputed_logprob_spans=[],
        invalid_logprob_spans=[list(span) for span in prefix.spans],
        logprobs_invalid=bool(prefix.spans) or last.logprobs_invalid,
        foreign_replies=prefix.foreign_replies,
    )
    return finish_segment(
        list(seg.steps),
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        metadata=metadata,
        **common,
    )


def verify_segment(seg: OpenSegment, tokenizer: ChatTokenizer) -> VerifyReport | VerifyFailure:
    """Compare the last step's recorded prompt with its conversation rendered afresh."""
    last = seg.steps[-1]
    request = seg.last_request
    if request is None:
        return VerifyFailure("the segment kept no request to re-render")
    try:
        report = verify_prompt(
            tokenizer,
            seg.context_ids[: last.prompt_len],
            request.messages,
            tools=request.tools or None,
            enable_thinking=request.enable_thinking,
        )
    except Exception as exc:  # the template refuses the conversation: report, never fail the close
        return VerifyFailure(f"{type(exc).__name__}: {exc}")
    return report
