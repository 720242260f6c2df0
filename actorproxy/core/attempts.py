"""What a generation attempt writes onto its step (sans-IO): sampled tokens, the engine's finish, a discarded attempt.

A turn may take several attempts (a pause interrupts one): ``start`` is where
the attempt's tokens begin in the step's output.
"""

from __future__ import annotations

import functools
import time
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .records import Step, version_number

if TYPE_CHECKING:  # the engine interface's event types, for annotations only: core/ does not import engines/
    from ..engines.base import GenerateFinish


def record_tokens(step: Step, ids: Sequence[int], logprobs: Sequence[float], version: str) -> None:
    """Append sampled tokens to the step: their ids, logprobs and the weight version that sampled them.

    What every token delta writes, whether it came as a ``TokenDelta`` or was relayed straight
    from the engine's read (``runtime/generate.py: TurnGeneration.take``).
    """
    if step.first_token_at is None:
        step.first_token_at = time.time()
    number = _number(version)
    if len(ids) == 1 == len(logprobs):  # (a streamed token alone, nearly every call: append is a third of extend)
        step.output_ids.append(ids[0])
        step.output_logprobs.append(logprobs[0])
        step.output_versions.append(number)
    else:
        step.output_ids.extend(ids)
        step.output_logprobs.extend(logprobs)
        step.output_versions.extend([number] * len(ids))
    step.weight_version = version
    if version:
        step.version_labels[number] = version


#: A label's number (``version_number``), remembered for the few labels a run of the proxy sees.
_number = functools.lru_cache(maxsize=256)(version_number)


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
            versions[lo:hi] = array("q", [number] * (hi - lo))
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
