"""What a turn sends the engine, and whether it fits: TITO planning, rendering and the prompt guards.

:func:`plan_prompt` takes one turn as :func:`~.tito.plan_turn` planned it:
continuing the open segment (only the new messages rendered as a fragment) or
starting afresh (the whole conversation rendered, or, with ``--on-history-rewrite
recompute``, rebuilt with the segment's replies located). It renders and tokenizes
accordingly (a fragment the template cannot render starts afresh), and applies
the prompt guards (``--max-prompt-tokens``, the context window) and the
``max_tokens`` clamp. It reads the segment and changes nothing:
a refused turn leaves no trace. Recording the turn (opening segments, the step)
is :class:`~.session_state.SessionState`'s.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

import attrs

from ..config import LimitSettings, ProxyConfig
from ..errors import BadRequest, ContextOverflow
from ..tokenization.message_fields import kept
from ..tokenization.tokenizer import ChatTokenizer
from .assemble import RebuiltPrefix, rebuild_prefix
from .requests import ChatRequest
from .spans import SpanError
from .tito import Continue, FragmentError, Fresh, OpenSegment, TurnPlan, render_fragment

log = logging.getLogger(__name__)


@attrs.frozen
class PromptPlan:
    """A turn's prompt, planned and within the limits (nothing recorded yet)."""

    #: ``Continue`` the open segment, or start a ``Fresh`` one (for its reason).
    plan: TurnPlan
    #: The whole prompt sent to the engine.
    input_ids: array[int]
    #: The tokens this turn adds to the segment (the fragment, or the whole prompt when fresh).
    fragment: array[int]
    #: The messages this turn accounts for, as the segment may keep them (``message_fields.kept``).
    new_messages: list[dict[str, Any]]
    max_new_tokens: int
    #: Recompute mode: the conversation rebuilt with the segment's replies located.
    rebuilt: RebuiltPrefix | None = None
    #: The fragment could not be rendered, so the turn starts afresh (``tito_failure``).
    fragment_failed: bool = False


def plan_prompt(
    tokenizer: ChatTokenizer,
    config: ProxyConfig,
    plan: TurnPlan,
    *,
    window: int,
    segment: OpenSegment | None,
    request: ChatRequest,
    session_id: str,
) -> PromptPlan:
    """Render and guard one turn planned by ``plan_turn``; raises :class:`BadRequest` or
    :class:`ContextOverflow` to refuse it."""
    fragment_failed, fragment_error = False, None
    if isinstance(plan, Continue):
        assert segment is not None
        try:
            text = render_fragment(
                tokenizer,
                plan.new_messages,
                tools=request.tools,
                closed_by_eot=segment.closed_by_eot,
                closed_by=segment.closed_by,
                enable_thinking=request.enable_thinking,
            )
            fragment = tokenizer.encode_fragment(text)  # a text an earlier turn sent is not tokenized again
            input_ids = segment.context_ids + fragment
            new_messages = [kept(m) for m in plan.new_messages]
        except FragmentError as exc:
            # Said once the whole conversation renders: when it does not either, the turn is refused (400).
            fragment_failed, fragment_error = True, exc
            plan = Fresh("tito_failure")
    rebuilt: RebuiltPrefix | None = None
    if isinstance(plan, Fresh):
        try:
            rebuilt = _rebuilt_prefix(tokenizer, config, segment, plan, request, session_id)
            if rebuilt is not None:
                fragment = rebuilt.ids
            else:
                text = tokenizer.render(
                    request.messages,
                    tools=request.tools,
                    add_generation_prompt=True,
                    enable_thinking=request.enable_thinking,
                )
                fragment = tokenizer.encode_prompt(text)  # what an earlier prompt started with is not tokenized again
        except Exception as exc:  # the template rejects these messages
            raise BadRequest(f"the chat template cannot render these messages: {exc}", param="messages") from exc
        if fragment_failed:
            log.warning("session %s: %s; starting a new segment", session_id, fragment_error)
        input_ids = array("i", fragment)
        new_messages = [kept(m) for m in request.messages]
    prompt_len = len(input_ids)
    limits = config.limits
    details = {"phase": "input", "context_window": window, "input_tokens": prompt_len, "output_tokens": 0,
               "max_tokens": request.max_tokens, "session_id": session_id, "last_proxy_step_recorded": False}
    if limits.max_prompt_tokens is not None and prompt_len > limits.max_prompt_tokens:
        raise ContextOverflow(prompt_len, window=window, max_prompt_tokens=limits.max_prompt_tokens,
                              param="messages", details=details)
    if prompt_len >= window:
        raise ContextOverflow(prompt_len, window=window, param="messages", details=details)
    max_new, bound = turn_budget(limits, request.max_tokens, window=window, prompt_len=prompt_len)
    extras = request.extras
    least = extras.min_tokens if extras is not None else 0
    farthest = max(extras.stop_token_ids, default=0) if extras is not None else 0
    if farthest >= tokenizer.id_bound:  # an index into the engine's logits (SGLang does not check it)
        raise BadRequest(f"'stop_token_ids' holds {farthest}, which is no token id of the model "
                         f"(ids are below {tokenizer.id_bound})", param="stop_token_ids")
    if least > max_new:  # as vLLM and SGLang refuse it, by name and before the engine is asked
        raise BadRequest(f"'min_tokens' is {least}, but this turn may generate at most {max_new} tokens ({bound})",
                         param="min_tokens")
    return PromptPlan(plan, input_ids, fragment, new_messages, max_new, rebuilt, fragment_failed)


def turn_budget(limits: LimitSettings, asked: int | None, *, window: int, prompt_len: int) -> tuple[int, str]:
    """The most tokens a generation may sample, and what set it: the ``max_tokens`` asked (else
    ``--default-max-tokens``), cut to ``--max-output-tokens`` and, with ``--dynamic-max-tokens``, to the context
    window's room after the prompt."""
    budget, bound = (asked, "max_tokens") if asked else (
        limits.default_max_tokens, "the default max_tokens (--default-max-tokens)")
    if limits.max_output_tokens is not None and limits.max_output_tokens < budget:
        budget, bound = limits.max_output_tokens, "--max-output-tokens"
    if limits.dynamic_max_tokens and window - prompt_len < budget:
        budget, bound = window - prompt_len, f"the context window's room after the prompt's {prompt_len} tokens"
    return budget, bound


def _rebuilt_prefix(
    tokenizer: ChatTokenizer,
    config: ProxyConfig,
    segment: OpenSegment | None,
    plan: Fresh,
    request: ChatRequest,
    session_id: str,
) -> RebuiltPrefix | None:
    """``--on-history-rewrite recompute``: the conversation rebuilt with this segment's replies marked.

    ``None`` when the segment is to be closed instead: segment mode, a
    session start, or a template whose assistant turns cannot be located.
    Raises whatever the template raises on these messages.
    """
    if config.trajectory.on_history_rewrite != "recompute" or segment is None:
        return None
    rewriting = bool(segment.steps) and plan.reason != "session_start"
    retaking = not segment.steps and bool(segment.rebuilt_steps)  # the rebuilding turn failed; this one replaces it
    if not (rewriting or retaking):
        return None
    try:
        return rebuild_prefix(
            tokenizer,
            request.messages,
            tools=request.tools,
            enable_thinking=request.enable_thinking,
            steps=[*segment.rebuilt_steps, *segment.steps],
        )
    except SpanError as exc:
        log.warning("session %s: cannot rebuild the prefix (%s); starting a new segment", session_id, exc)
        return None
