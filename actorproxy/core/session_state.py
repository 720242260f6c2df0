"""One session's state as a sans-IO state machine (the h11 ``Connection`` model).

:class:`SessionState` owns everything a session records: its steps, its
conversations (:mod:`.lanes`: the main one and side calls, each with its open
segment and TITO state), retries, sub-agent child keys, the step guard, and
the opening and closing of segments; what a turn sends the engine (TITO
planning, rendering, the prompt guards) is :func:`.prompt_plan.plan_prompt`'s.
It does no I/O and never awaits: the session actor feeds it a request (:meth:`SessionState.prepare`),
runs the generation itself, hands back the outcome (:meth:`SessionState.commit`)
and asks for the closed segments (:meth:`SessionState.close`). Rendering,
tokenizing and segment assembly all happen in these calls, so the actor runs
them in a worker thread; between calls the state is only touched by its actor.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs

from ..config import ProxyConfig
from ..errors import ProxyError, StepLimitExceeded
from ..tokenization.tokenizer import ChatTokenizer
from .assemble import SegmentIdentity, assemble_segment
from .lanes import Conversations, Lane, conversation_key, one_shot
from .messages import tools_key
from .prompt_plan import plan_prompt
from .records import Segment, Step, float_array, sub_agent_of
from .requests import ChatRequest, Identity, holding
from .template_probe import probe_template
from .tito import Fresh, OpenSegment, TurnPlan, plan_turn

log = logging.getLogger(__name__)


@attrs.frozen
class Refusal:
    """A guard refused the turn; nothing was recorded."""

    error: ProxyError


@attrs.frozen
class Moved:
    """The turn is a sub-agent's: it belongs to the child session ``session_id``."""

    session_id: str


@attrs.define(eq=False)
class Planned:
    """A turn cut, routed and planned, nothing rendered yet (:meth:`SessionState.plan`)."""

    #: The request, its messages cut to what the template reads.
    request: ChatRequest
    identity: Identity
    #: The tools' key (``messages.tools_key``).
    key: str
    #: ``Continue`` the open segment or start a ``Fresh`` one.
    plan: TurnPlan
    #: A retry of the segment's last turn: that step and its request, taken back out of the segment.
    retried: tuple[Step, Any] | None


@attrs.define(eq=False)
class Prepared:
    """A planned turn whose step is recorded (``running``): the actor generates it next."""

    step: Step
    input_ids: array[int]
    new_messages: list[dict[str, Any]]
    temperature: float
    top_p: float
    #: Segments this turn closed (a boundary): they go to the store before generating.
    closed: list[Segment]
    #: The request as planned: its messages are the cut list, the session's own (not the caller's).
    request: ChatRequest
    #: The conversation the turn belongs to.
    lane: Lane


@attrs.frozen
class TurnResult:
    """How a prepared turn ended. Only a ``completed`` turn (delivered to the agent) joins the segment."""

    prepared: Prepared
    completed: bool


class SessionState:
    """Steps, the open segment and the TITO state of one session; no I/O."""

    def __init__(
        self,
        session_id: str,
        *,
        config: ProxyConfig,
        tokenizer: ChatTokenizer,
        context_window: int,
        next_step: int = 0,
        next_segment: int = 0,
    ) -> None:
        self.session_id = session_id
        self._config = config
        self._tok = tokenizer
        self._window = context_window
        self.next_step = next_step
        self.next_segment = next_segment
        self.steps: list[Step] = []
        #: Cuts each turn's messages to what the template reads; only the ones not seen last turn cost work.
        self.message_cut = tokenizer.message_cut()
        self.instance_id: str | None = None
        #: The gateway's channel, once a call named it: written on the segments (``metadata.channel``).
        self.channel: str | None = None
        #: What the gateway's ``register_trajectory`` said of it (dataset fields): written on the segments.
        self.trajectory_metadata: dict[str, Any] | None = None
        self._rollout_id: str | None = None
        #: Set on a sub-agent's child session: ``(parent session id, "sub-<n>")``.
        self._sub_agent = sub_agent_of(session_id)
        #: The session's conversations (one, unless side calls are told apart) and its sub-agents.
        self._talks = Conversations(
            session_id,
            side_calls=config.trajectory.side_calls != "off" and self._sub_agent is None,
            sub_agents=config.trajectory.sub_agents != "off" and self._sub_agent is None,
        )

    @property
    def segment(self) -> OpenSegment | None:
        """The open segment of the conversation the current turn belongs to."""
        return self._talks.active.segment

    @segment.setter
    def segment(self, value: OpenSegment | None) -> None:
        self._talks.active.segment = value

    @property
    def children(self) -> list[str]:
        return list(self._talks.children.values())

    # -- a turn -----------------------------------------------------------------------

    def prepare(self, request: ChatRequest, identity: Identity) -> Prepared | Refusal | Moved:
        """Route, plan and guard a turn. On :class:`Prepared` the step is recorded as ``running``."""
        planned = self.plan(request, identity)
        return self.render(planned) if isinstance(planned, Planned) else planned

    def plan(self, request: ChatRequest, identity: Identity) -> Planned | Refusal | Moved:
        """The first half of :meth:`prepare`: cut, route and plan the turn, without rendering anything.

        A :class:`Planned` turn must be handed to :meth:`render` next (a retried
        turn has been taken back out of the segment meanwhile).
        """
        # Fields nothing reads are not rendered, matched or kept (issue 11 #6: they cost memory, not tokens). The
        # cut list is the session's own (a new one each turn, never changed after): the turn keeps it as it is,
        # and a caller in this process may go on appending to its own list.
        request = holding(request, self.message_cut.cut(request.messages))
        child = self._talks.route(request.messages, identity.sub_agent)
        if child is not None:
            return Moved(child)
        lane = self._talks.active
        if self.next_step >= self._config.limits.max_steps_per_session:
            return Refusal(StepLimitExceeded(
                f"session {self.session_id!r} already has {self.next_step} steps "
                f"(--max-steps-per-session {self._config.limits.max_steps_per_session})"
            ))
        key = tools_key(request.tools)
        retried = self._take_back_retried(request, identity, key)
        if retried is not None:
            lane.turns -= 1
        elif lane.turns:
            self._talks.continued(lane)
        planned = Planned(request, identity, key, Fresh("session_start"), retried)
        try:
            append_only = probe_template(self._tok).append_only
            planned.plan = plan_turn(self.segment, request.messages, key, append_only=append_only)
        except ProxyError as exc:
            return self._refused(planned, exc)
        return planned

    def render(self, planned: Planned) -> Prepared | Refusal:
        """The second half of :meth:`prepare`: render, tokenize and guard the planned turn, and record its step."""
        try:
            prepared = self._plan_and_guard(planned)
        except ProxyError as exc:
            return self._refused(planned, exc)
        lane = self._talks.active
        lane.offers_tools = bool(planned.request.tools)
        if planned.retried is not None:
            old = planned.retried[0]
            old.status = "superseded"
            old.superseded_by = prepared.step.index
            prepared.step.retry_of = old.index
        return prepared

    def _refused(self, planned: Planned, exc: ProxyError) -> Refusal:
        """A planned turn is refused: a retried turn taken back goes back into the segment."""
        if planned.retried is not None and self.segment is not None:
            step, retried_request = planned.retried
            self.segment.push_back(step, step.new_messages, retried_request, self._tok.turn_end_ids)
            self._talks.active.turns += 1
        return Refusal(exc)

    def commit(self, result: TurnResult) -> None:
        """Record how the turn ended: a completed turn joins the open segment."""
        if not result.completed:
            return  # the step keeps the status the generation gave it, out of the segment
        prepared = result.prepared
        lane = prepared.lane
        seg = lane.segment
        assert seg is not None
        prepared.step.status = "completed"
        seg.add_turn(prepared.step, prepared.new_messages, prepared.request, self._tok.turn_end_ids)
        lane.turns += 1
        lane.last_step = prepared.step.index
        if prepared.step.output is not None and prepared.step.output.tool_calls:
            self._talks.continued(lane)  # it waits for the tools' results: it goes on

    def close(
        self, reason: str, reward: float | None = None, metadata: Mapping[str, Any] | None = None
    ) -> list[Segment]:
        """The session ends: close every conversation's open segment; returns those that had steps.

        ``metadata`` (the finalize's ``label``) goes on each of them.
        """
        closed: list[Segment] = []
        for lane, side in self._talks.at_end():
            closed += self._close_lane(lane, reason, reward, side=side, extra=metadata)
        return closed

    def _close_active(self, reason: str) -> list[Segment]:
        """A boundary in the active conversation: close its open segment."""
        lane = self._talks.active
        return self._close_lane(lane, reason, None, side=self._talks.is_side(lane))

    def _close_lane(
        self, lane: Lane, reason: str, reward: float | None, *, side: bool, extra: Mapping[str, Any] | None = None
    ) -> list[Segment]:
        """Close a conversation's open segment (building its sample), labelled a side call or not."""
        seg = lane.segment
        lane.segment = None
        if seg is None or not seg.steps:
            return []
        trajectory = self._config.trajectory
        if self._sub_agent is not None and trajectory.side_calls != "off" and one_shot(lane, seg, reason):
            side = True  # a sub-agent's conversation that ended after one turn: a side call
        # A sub-agent's segment in --sub-agents log mode stays out of training, side call or not.
        sub_agent_log = self._sub_agent is not None and trajectory.sub_agents == "log"
        if sub_agent_log or (side and trajectory.side_calls == "log"):
            for step in seg.steps:  # log mode: the steps are kept, no training sample
                step.in_segment = False
            log.info("session %s: %s of %d step(s) kept as steps only (log mode)", self.session_id,
                     "a side call" if side else "a sub-agent's segment", len(seg.steps))
            return []
        parent = self._sub_agent[0] if self._sub_agent is not None else self.session_id
        metadata: dict[str, Any] = {}
        if self._sub_agent is not None:
            metadata["sub_agent"] = self._sub_agent[1]
        if side:
            metadata["side_call"] = True
        if self.channel is not None:
            metadata["channel"] = self.channel
        if self.trajectory_metadata:
            metadata["trajectory_metadata"] = self.trajectory_metadata
        tolerated = Counter(kind for message in seg.accounted for kind in message.tolerated)
        if tolerated:  # replies the client echoed rewritten, still matched (see core/messages.py)
            metadata["echo_tolerated"] = dict(sorted(tolerated.items()))
        if extra:
            metadata.update(extra)
        if self._config.server.api_dialect == "dressage":  # its records carry the engine's labels, not numbers
            labels = {number: label for step in seg.steps for number, label in step.version_labels.items()}
            metadata["version_labels"] = {str(number): labels[number] for number in sorted(labels)}
        who = SegmentIdentity(
            session_id=self.session_id,
            parent_traj_id=parent,
            instance_id=self.instance_id,
            rollout_id=self._rollout_id or parent,
            boundary_reason=reason,
            reward=reward,
            metadata=metadata,
        )
        return [
            assemble_segment(
                seg,
                self._tok,
                who,
                mode=self._config.trajectory.trajectory_build_mode,
                verify=self._config.trajectory.verify_tito,
                mask_nonlast_version=self._config.trajectory.mask_nonlast_version_tokens,
            )
        ]

    def take_steps(self) -> tuple[Step, ...]:
        """Every step recorded so far, handed over (to the store); the list starts empty again."""
        steps, self.steps = tuple(self.steps), []
        return steps

    # -- routing and retries ------------------------------------------------------------

    def _take_back_retried(self, request: ChatRequest, identity: Identity, key: str) -> tuple[Step, Any] | None:
        """A retry of the segment's last turn: take that turn back out of the segment.

        A retry is the same ``X-Turn-Id`` as the last step, or the last step's
        request sent again. Returns the step and its request (to put back if
        the retry is refused), or ``None``.
        """
        seg = self.segment
        if seg is None or not seg.steps:
            return None
        last = seg.steps[-1]
        same_turn = identity.turn_id is not None and identity.turn_id == last.turn_id
        if not same_turn and not (key == seg.tools_key and seg.repeats_last_request(request.messages)):
            return None
        retried_request = seg.last_request
        return seg.pop_last(), retried_request

    # -- recording a planned turn ----------------------------------------------------------

    def _plan_and_guard(self, turn: Planned) -> Prepared:
        request, identity, key = turn.request, turn.identity, turn.key
        planned = plan_prompt(
            self._tok, self._config, turn.plan, window=self._window, segment=self.segment, request=request,
            session_id=self.session_id,
        )
        # Guards passed: from here on the turn is recorded.
        if identity.instance_id:
            self.instance_id = identity.instance_id
        if identity.rollout_id:
            self._rollout_id = identity.rollout_id
        boundary: str | None = None
        closed: list[Segment] = []
        rebuilt = planned.rebuilt
        if isinstance(planned.plan, Fresh):
            if rebuilt is not None:
                boundary = self._rebuild_segment(planned.plan.reason, key)
            else:
                boundary, closed = self._open_segment(planned.plan.reason, key)
            self._talks.active.key = conversation_key(request.messages)
        seg = self.segment
        assert seg is not None
        step = Step(
            index=self.next_step,
            session_id=self.session_id,
            segment_index=seg.index,
            turn_id=identity.turn_id,
            instance_id=self.instance_id,
            new_messages=planned.new_messages,
            message_count=len(request.messages),
            prompt_len=len(planned.input_ids),
            fragment_ids=planned.fragment,
            max_new_tokens=planned.max_new_tokens,
            boundary_reason=boundary,
            incremental_tokenization_failed=planned.fragment_failed,
        )
        if rebuilt is not None:
            step.fragment_mask = rebuilt.mask
            step.fragment_versions = rebuilt.versions
            step.fragment_logprobs = float_array(bytes(4 * len(rebuilt.ids)))
            step.rebuilt_spans = rebuilt.spans
            step.logprobs_invalid = bool(rebuilt.spans)  # until the engine's prompt logprobs fill them in
        self.next_step += 1
        self.steps.append(step)
        temperature = self._config.limits.rollout_temperature
        if temperature is None:
            temperature = request.temperature
            if temperature is None:
                temperature = self._config.limits.default_temperature
        top_p = 1.0 if request.top_p is None else request.top_p
        return Prepared(
            step, planned.input_ids, planned.new_messages, temperature, top_p, closed, request, self._talks.active
        )

    def _open_segment(self, reason: str, key: str) -> tuple[str, list[Segment]]:
        """Start a new segment for ``reason``; returns the reason recorded and the closed segments.

        An open segment with no steps yet (its only turn failed) is reused: the
        reason it was opened for is still the true one.
        """
        current = self.segment
        if current is not None and not current.steps:
            current.tools_key = key
            return current.start_reason, []
        closed = self._close_active(reason)
        self.segment = OpenSegment(index=self.next_segment, start_reason=reason, tools_key=key)
        self.next_segment += 1
        return reason, closed

    def _rebuild_segment(self, reason: str, key: str) -> str:
        """Rebuild the open segment in place (recompute mode); returns the reason recorded on the step."""
        seg = self.segment
        assert seg is not None
        if seg.steps:
            seg.rebuild(reason, key)
            return reason
        # The rebuilding turn failed and this one takes its place.
        seg.tools_key = key
        return seg.rebuilds[-1] if seg.rebuilds else seg.start_reason

