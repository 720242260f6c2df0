"""What a generation attempt writes onto its step (sans-IO): token deltas, the engine's finish, a discarded attempt.

A turn may take several attempts (a pause interrupts one): ``start`` is where
the attempt's tokens begin in the step's output.
"""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING

from .records import Step, version_number

if TYPE_CHECKING:  # the engine interface's event types, for annotations only: core/ does not import engines/
    from ..engines.base import GenerateFinish, TokenDelta


def record_delta(step: Step, event: TokenDelta) -> None:
    """Append a delta's ids, logprobs and weight versions to the step."""
    if step.first_token_at is None:
        step.first_token_at = time.time()
    step.output_ids.extend(event.token_ids)
    step.output_logprobs.extend(event.logprobs)
    number = version_number(event.weight_version)
    step.output_versions.extend([number] * len(event.token_ids))
    step.weight_version = event.weight_version
    if event.weight_version:
        step.version_labels[number] = event.weight_version


def apply_finish(step: Step, finish: GenerateFinish, start: int, experts: list[str]) -> None:
    """Fold an attempt's finish into the step: authoritative version spans, routed experts.

    ``experts`` collects the routed experts of the turn's attempts (one entry per attempt that reported them).
    """
    if finish.weight_version and not step.weight_version:
        step.weight_version = finish.weight_version
    versions = step.output_versions
    for span in finish.weight_versions:
        # The engine's spans are authoritative (vLLM reports them only at the end).
        lo, hi = start + span.start, min(start + span.end, len(versions))
        if hi > lo:
            number = version_number(span.version)
            versions[lo:hi] = array("i", [number] * (hi - lo))
            step.version_labels[number] = span.version
    if finish.weight_versions:
        step.weight_version = finish.weight_versions[-1].version
    if finish.routed_experts is not None:
        experts.append(finish.routed_experts)
        if len(experts) == 1:
            step.routed_experts = finish.routed_experts
        else:
            step.routed_experts, step.routed_experts_chunks = None, list(experts)


def discard_attempt(step: Step, start: int) -> None:
    """Move the attempt's tokens to the step's ``discarded`` list (kept, out of training)."""
    step.discarded.append(
        {
            "output_ids": step.output_ids[start:].tolist(),
            "output_logprobs": step.output_logprobs[start:].tolist(),
            "output_versions": step.output_versions[start:].tolist(),
            "weight_version": step.weight_version,
        }
    )
    del step.output_ids[start:], step.output_logprobs[start:], step.output_versions[start:]
    step.weight_version = ""
    step.routed_experts, step.routed_experts_chunks = None, None
