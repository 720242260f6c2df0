"""The Claw-R1 gateway's surface on the session actors: white-box ``/generate``, black-box base URLs,
rewards, readiness, and the trainer's hand-off by prompt group.

A gateway call is one more way into a session, never a second recording path:
``/generate`` is a turn of session ``trajectory_uid`` in prompt group
``prompt_uid`` (same TITO, segments, pauses and versions as chat completions),
and its ``response_ids`` / ``prompt_ids`` are exactly what the engine sampled
and was given. ``/init_trajectory`` hands out a base URL
``http://<host>/<trajectory_uid>/<prompt_uid>``, under which an agent's
``/v1/chat/completions`` and ``/v1/messages`` land in that trajectory;
completing a trajectory finalizes its session and, on the ``train`` channel,
queues it for ``/trajectory/fetch_batch``. Bodies of these routes are ours:
unknown fields are refused (400 naming the field), errors are OpenAI's format.
"""

from __future__ import annotations

import logging
import math
import uuid
from array import array
from collections import OrderedDict
from functools import partial
from typing import Any

import attrs
import orjson
import trio
from quart import Response, g, request
from quart_trio import QuartTrio

from ..core.messages import output_as_message
from ..core.records import Segment
from ..core.requests import Identity, sampling_extras
from ..core.turn_events import TurnDone
from ..errors import (
    BadRequest,
    NotConfigured,
    NotFound,
    Overloaded,
    RewardFailed,
    RewardTimeout,
    StartupError,
)
from ..http.cycle import delivered
from ..protocols.gateway_models import (
    Channel,
    CompleteBody,
    CompleteResult,
    FetchBatchBody,
    FetchBatchResult,
    GenerateBody,
    GenerateResult,
    GroupBatch,
    HandedTrajectory,
    InitBody,
    InitResult,
    Lease,
    NotReady,
    ReadyResult,
    RegisterBody,
    RegisterResult,
    RewardBody,
    RewardResult,
    SubmitStepsBody,
    SubmitStepsResult,
    TokenGenerateBody,
    TokenGenerateResult,
    TokenRewardBody,
    TokenRewardResult,
)
from ..protocols.openai_chat import parse_chat_body
from ..reward_worker import RayRewardWorker
from ..rewards import RewardFunctionError, as_reward, is_async, load_reward_fn
from ..runtime import store as st
from ..runtime.actor import ActorGone, ask
from ..runtime.handoff import Group, GroupHandoff
from ..runtime.messages import Lookup
from ..runtime.runtime import Runtime
from ..runtime.store import encode_body
from ..runtime.submitted_steps import StepStored, SubmitResult, SubmitSteps, SubmittedStep
from ..runtime.token_in import TokenInGenerations, generate_tokens, store_unclaimed
from ..schema import jsonio
from ..schema.converter import CONVERTER, structure
from ..store.base import Held, ReadQuery
from .auth import AccessPolicy
from .identity import MAX_ID_LENGTH
from .lane import served_by_the_lane
from .turns import EarlyStart, still_working

log = logging.getLogger(__name__)

#: Trajectories whose channel and metadata are remembered (oldest forgotten first).
_TRAJECTORY_MEMORY = 100_000
#: The longest a fetch_batch call may wait.
MAX_FETCH_WAIT = 600.0


async def _body(kind: type[Any], *, optional: bool = False) -> Any:
    raw = await request.get_data(cache=False, as_text=False)
    assert isinstance(raw, bytes)
    if optional and not raw.strip():
        return kind()
    return structure(jsonio.loads(raw), kind)


def _uid(value: str, name: str) -> str:
    value = value.strip()
    if not value or len(value) > MAX_ID_LENGTH or "/" in value or any(ord(c) < 32 for c in value):
        raise BadRequest(f"'{name}' must be 1-{MAX_ID_LENGTH} printable characters without '/'", param=name)
    return value


#: The longest channel name.
MAX_CHANNEL_LENGTH = 64


def _channel(value: str, name: str = "channel") -> str:
    """A channel name: ``train`` trains; any other (``validate``, Claw-R1's ``val``) never reaches training."""
    if not value or len(value) > MAX_CHANNEL_LENGTH or not value.isprintable() or "/" in value:
        raise BadRequest(f"'{name}' must be 1-{MAX_CHANNEL_LENGTH} printable characters without '/'", param=name)
    return value


def _reply(result: Any, status: int = 200) -> Response:
    """A reply model as JSON (unstructured by the wire converter)."""
    return Response(orjson.dumps(CONVERTER.unstructure(result)), status=status, mimetype="application/json")


# -- state --------------------------------------------------------------------------------


@attrs.define
class Trajectory:
    prompt_uid: str
    channel: Channel = "train"
    metadata: dict[str, Any] = attrs.field(factory=dict)
    #: Segments its external steps (``/submit_steps``) stored.
    external_segments: int = 0


@attrs.define
class Gateway:
    """What the gateway remembers: trajectories' channels and metadata, and the hand-off."""

    handoff: GroupHandoff
    #: Token-in ``/generate`` results waiting for the ``/submit_steps`` that claims them.
    generations: TokenInGenerations
    trajectories: OrderedDict[str, Trajectory] = attrs.field(factory=OrderedDict)

    def remember(self, uid: str, trajectory: Trajectory) -> Trajectory:
        self.trajectories.pop(uid, None)
        self.trajectories[uid] = trajectory
        while len(self.trajectories) > _TRAJECTORY_MEMORY:
            self.trajectories.popitem(last=False)
        return trajectory


# -- routes -------------------------------------------------------------------------------


def add_gateway_routes(app: QuartTrio, runtime: Runtime, policy: AccessPolicy) -> Gateway:
    settings = runtime.config.gateway
    gateway = Gateway(GroupHandoff(max_pending_groups=settings.max_pending_groups),
                      TokenInGenerations(ttl=runtime.config.limits.session_ttl))
    reward_fn = load_reward_fn(settings.reward_fn) if settings.reward_fn else None
    reward_threads = trio.CapacityLimiter(4)
    reward_worker = reward_worker_for(runtime) if settings.reward_worker_name else None

    async def store_waiting_generations() -> None:  # at shutdown: kept as steps, not lost
        await store_unclaimed(runtime, gateway.generations, gateway.generations.expired(math.inf))

    runtime.before_close.append(store_waiting_generations)

    def base_url(trajectory_uid: str, prompt_uid: str) -> str:
        root = settings.advertise_url or request.host_url
        suffix = "/v1" if settings.init_base_url == "v1" else ""
        return f"{root.rstrip('/')}/{trajectory_uid}/{prompt_uid}{suffix}"

    @app.get("/ready")
    async def ready() -> Response:
        if not await runtime.backend_healthy():
            return _reply(NotReady("not ready: no inference engine is healthy yet"), 503)
        return _reply(ReadyResult("ready"))

    # POST /generate is a turn: the turn lane serves it (generate_turn); the rule routes other methods.
    app.add_url_rule("/generate", view_func=served_by_the_lane, methods=["POST"], endpoint="generate")

    @app.post("/init_trajectory")
    async def init_trajectory() -> Response:
        body: InitBody = await _body(InitBody, optional=True)
        trajectory_uid = uuid.uuid4().hex
        prompt_uid = _uid(body.prompt_uid, "prompt_uid") if body.prompt_uid is not None else uuid.uuid4().hex
        channel = _channel(body.channel)
        gateway.remember(trajectory_uid, Trajectory(prompt_uid, channel, dict(body.metadata)))
        key = policy.session_key(trajectory_uid) if policy.agent_auth == "session-key" else None
        return _reply(InitResult(trajectory_uid, prompt_uid, channel, base_url(trajectory_uid, prompt_uid), key))

    @app.post("/<url_session>/<url_instance>/v1/register_trajectory")
    async def register_trajectory(url_session: str, url_instance: str) -> Response:
        body: RegisterBody = await _body(RegisterBody, optional=True)
        trajectory = gateway.remember(
            _uid(url_session, "trajectory_uid"), Trajectory(_uid(url_instance, "prompt_uid"), _channel(body.channel),
                                                            dict(body.metadata))
        )
        return _reply(RegisterResult("ok", url_session, trajectory.prompt_uid, trajectory.channel))

    async def finish(trajectory_uid: str, prompt_uid: str | None, body: CompleteBody) -> CompleteResult:
        """Finalize the session and, on the train channel, queue it for the hand-off."""
        known = gateway.trajectories.pop(trajectory_uid, None)
        channel = _channel(body.channel) if body.channel is not None else (known.channel if known else "train")
        instance = prompt_uid or (known.prompt_uid if known else None)
        result = await runtime.finalize(trajectory_uid, reward=body.reward, instance_id=instance, channel=channel,
                                        metadata=dict(known.metadata) if known and known.metadata else None)
        queued = False
        stored = result.segments or (known is not None and known.external_segments)
        if channel == "train" and instance is not None and stored:
            queued = gateway.handoff.complete(trajectory_uid, instance, body.reward)
        return CompleteResult("ok", trajectory_uid, instance, channel, queued, result.segments, result.steps)

    async def complete(trajectory_uid: str, prompt_uid: str | None, body: CompleteBody) -> Response:
        return _reply(await finish(trajectory_uid, prompt_uid, body))

    @app.post("/<url_session>/<url_instance>/v1/complete_trajectory")
    async def complete_under_base_url(url_session: str, url_instance: str) -> Response:
        body: CompleteBody = await _body(CompleteBody, optional=True)
        if url_session == "sess":  # /sess/<id>/v1/...: the per-session mount, as on the model routes
            trajectory_uid, prompt_uid = _uid(url_instance, "trajectory_uid"), None
        else:
            trajectory_uid, prompt_uid = _uid(url_session, "trajectory_uid"), _uid(url_instance, "prompt_uid")
        grading = body.reward is not None or body.channel is not None
        if not policy.completes(request.headers, g.admitted.confined, trajectory_uid, grading=grading):
            # Its own agent's word that it is done: the trainer completes it (reward, hand-off).
            known = gateway.trajectories.get(trajectory_uid)
            return _reply(CompleteResult("awaiting_trainer", trajectory_uid, prompt_uid or (
                known.prompt_uid if known else None), known.channel if known else "train", False))
        return await complete(trajectory_uid, prompt_uid, body)

    @app.post("/complete_trajectory/<trajectory_uid>")
    async def complete_by_id(trajectory_uid: str) -> Response:
        body: CompleteBody = await _body(CompleteBody, optional=True)
        return await complete(_uid(trajectory_uid, "trajectory_uid"), None, body)

    async def token_reward(body: TokenRewardBody) -> Response:
        """The gateway's token body: the Ray reward worker's score, else ``--reward-fn`` on the decoded texts."""
        if body.multi_modal_data:
            raise BadRequest("'multi_modal_data' is not supported: the proxy serves text models",
                             param="multi_modal_data")
        for kind in ("prompt_ids", "response_ids"):
            _token_ids(getattr(body, kind), kind, runtime.tokenizer.id_bound)
        if reward_worker is not None:
            await reward_worker.connected()
            score, extra = await reward_worker.worker.score(
                body.prompt_ids, body.response_ids, body.num_turns, dict(body.extra_fields), dict(body.dataset_fields))
            return _reply(TokenRewardResult(score, extra))
        tok = runtime.tokenizer
        messages = [{"role": "user", "content": tok.decode(body.prompt_ids)},
                    {"role": "assistant", "content": tok.decode(body.response_ids)}]
        reward = await call_reward_fn(messages, dict(body.dataset_fields))
        return _reply(TokenRewardResult(reward))

    @app.post("/compute_reward")
    async def compute_reward() -> Response:
        raw = jsonio.loads(await request.get_data(cache=False, as_text=False))
        if isinstance(raw, dict) and "prompt_ids" in raw:
            return await token_reward(structure(raw, TokenRewardBody))
        body: RewardBody = structure(raw, RewardBody)
        reward = await call_reward_fn(list(body.messages), dict(body.dataset_fields))
        return _reply(RewardResult(body.trajectory_uid, reward))

    async def call_reward_fn(messages: list[Any], fields: dict[str, Any]) -> float:
        if reward_fn is None:
            raise NotConfigured(
                "no reward function: start the proxy with --reward-fn module:callable (or a shipped one: "
                "--reward-fn gsm8k, --reward-fn exact_match), or --reward-worker-name NAME"
            )
        name, fn = reward_fn
        try:
            with trio.fail_after(settings.reward_timeout):
                if is_async(fn):
                    value = await fn(messages, fields)  # type: ignore[misc]
                else:
                    value = await trio.to_thread.run_sync(fn, messages, fields, limiter=reward_threads,
                                                          abandon_on_cancel=True)
        except trio.TooSlowError:
            raise RewardTimeout(f"reward function {name} took longer than {settings.reward_timeout:g} s") from None
        except RewardFunctionError as exc:
            raise RewardFailed(f"reward function {name}: {exc}") from None
        except Exception as exc:  # the user's function failed: say which, never a 500
            raise RewardFailed(f"reward function {name} raised {type(exc).__name__}: {exc}") from None
        try:
            return as_reward(name, value)
        except RewardFunctionError as exc:
            raise RewardFailed(str(exc)) from None

    async def submit_to(
        trajectory_uid: str, steps: list[SubmittedStep], *, apply: bool, channel: str | None = None
    ) -> SubmitResult | None:
        """Check (or apply) one trajectory's steps in its session actor; ``None``: no session yet, all external."""
        for _ in range(4):
            mailbox = await ask(runtime.registry, lambda r: Lookup(trajectory_uid, apply, r))
            if mailbox is None:
                if await ask(runtime.store, lambda r: st.Knows(trajectory_uid, r)):
                    raise StepStored(f"trajectory {trajectory_uid!r} was already completed and stored; submit its "
                                     "steps before completing it", param="steps")
                return None
            try:
                result: SubmitResult | None = await ask(mailbox, lambda r: SubmitSteps(tuple(steps), apply, r, channel))
                return result
            except ActorGone:
                continue  # the session retired between lookup and send: ask again
        raise Overloaded(f"session {trajectory_uid!r} is restarting; retry")

    @app.post("/submit_steps")
    async def submit_steps() -> Response:
        query = request.args.get("channel")  # Claw-R1's flows name the channel here (validation: "val")
        channel = _channel(query, "channel (query)") if query is not None else None
        body: SubmitStepsBody = await _body(SubmitStepsBody)
        by_trajectory = _submitted(body, runtime.tokenizer.id_bound)
        for uid, steps in by_trajectory.items():  # every check before anything is applied
            await submit_to(uid, steps, apply=False)
        attached = external = 0
        for uid, steps in by_trajectory.items():
            # A token-in /generate that sampled exactly these ids gives the step its recorded logprobs.
            steps = [attrs.evolve(s, generated=gateway.generations.claim(s.prompt_ids, s.response_ids)) for s in steps]
            by_trajectory[uid] = steps
            result = await submit_to(uid, steps, apply=True, channel=channel)
            assert result is not None
            attached, external = attached + result.attached, external + result.external
            trajectory = gateway.trajectories.get(uid) or gateway.remember(uid, Trajectory(steps[0].prompt_uid))
            if channel is not None:
                trajectory.channel = channel
            trajectory.external_segments += result.external
        completed = []
        for uid, steps in by_trajectory.items():
            last = steps[-1]
            if last.is_last:  # completes the trajectory: finalize, then the hand-off (train channel only)
                await finish(uid, last.prompt_uid, CompleteBody(reward=last.reward))
                completed.append(uid)
        return _reply(SubmitStepsResult(len(body.steps), attached, external, completed))

    fetching = trio.Lock()  # one hand-off at a time: a group is never given to two trainers

    @app.post("/trajectory/fetch_batch")
    async def fetch_batch() -> Response:
        body: FetchBatchBody = await _body(FetchBatchBody)
        if body.groups < 1 or body.rollouts_per_group < 1:
            raise BadRequest("'groups' and 'rollouts_per_group' must be at least 1")
        if not 0 <= body.timeout_s <= MAX_FETCH_WAIT:
            raise BadRequest(f"'timeout_s' must be between 0 and {MAX_FETCH_WAIT:g}", param="timeout_s")
        deadline = trio.current_time() + body.timeout_s
        while True:
            with trio.move_on_at(deadline):
                await gateway.handoff.wait_ready(body.groups, body.rollouts_per_group)
            async with fetching:
                groups, complete_ = gateway.handoff.peek(body.groups, body.rollouts_per_group)
                if complete_ or trio.current_time() >= deadline:
                    return await hand_over(groups, complete_, body.lease)
            # Another trainer took groups this call waited for: wait again until the deadline.

    async def hand_over(groups: list[Group], complete_: bool, seconds: float | None) -> Response:
        """Read (holding what each trajectory's drain deletes), serialise, send, and only then delete: a reply
        that cannot be built or is not received loses nothing, and its groups go back to the queue. Leased
        (``seconds``), the batch is deleted once the trainer acknowledges it, and given back (its groups
        first in the queue again) if it does not in time."""
        found: dict[str, list[Segment]] = {}
        held: list[Held] = []
        leases = runtime.leases
        leased = Lease(leases.new_lease(), seconds) if seconds is not None else None
        try:
            for group in groups:
                for item in group.trajectories:
                    try:
                        result, holding = await runtime.hold_read(ReadQuery(item.trajectory_id, drain=True))
                    except NotFound:
                        found[item.trajectory_id] = []  # already read (drained) with /trajectory/read
                        continue
                    found[item.trajectory_id] = result.data
                    held.append(holding)

            def serialise() -> bytes:  # token arrays of a whole batch: in a worker thread, not on the event loop
                data = [GroupBatch(group.instance_id, [
                    HandedTrajectory(item.trajectory_id, item.reward,
                                     [CONVERTER.unstructure(s) for s in found[item.trajectory_id]])
                    for item in group.trajectories]) for group in groups]
                return encode_body(FetchBatchResult(data, complete_, leased))

            reply = await trio.to_thread.run_sync(serialise)
        except BaseException:
            if leased is not None:
                leases.drop(leased.id)
            await runtime.let_go(tuple(held))
            raise
        gateway.handoff.remove(groups)  # (no other fetch takes them; back in the queue if not delivered)

        def given_up() -> None:
            gateway.handoff.restore(groups)
            if leased is not None:
                leases.drop(leased.id)

        keep = None
        if leased is not None:
            back = partial(gateway.handoff.restore, groups)
            if not held:  # (nothing read to hold: every trajectory was drained already) the groups wait for it
                leases.keep(leased.id, (), leased.seconds, back)
            keep = partial(leases.keep, leased.id, seconds=leased.seconds, let_go=back)
        body = runtime.delivered_reply(reply, held, given_up=given_up, keep=keep,
                                       delivered=partial(delivered, request.scope))
        return Response(body, mimetype="application/json")

    return gateway


@attrs.define
class _RewardWorker:
    """The Ray reward worker, found on first use (``actorproxy run`` checked it at start-up)."""

    worker: RayRewardWorker
    ready: bool = False
    lock: trio.Lock = attrs.field(factory=trio.Lock)

    async def connected(self) -> None:
        async with self.lock:
            if not self.ready:
                try:
                    await trio.to_thread.run_sync(self.worker.connect)
                except StartupError as exc:
                    raise NotConfigured(str(exc)) from None
                self.ready = True


def reward_worker_for(runtime: Runtime) -> _RewardWorker:
    config = runtime.config
    tok = runtime.tokenizer
    pad = getattr(tok.hf, "pad_token_id", None)
    return _RewardWorker(RayRewardWorker(
        config.gateway.reward_worker_name or "", address=config.store.ray_address,
        namespace=config.store.ray_namespace, pad_id=int(pad if pad is not None else tok.eot_token_id),
        prompt_length=config.limits.max_prompt_tokens or runtime.context_window,
        response_length=config.limits.default_max_tokens, timeout=config.gateway.reward_timeout,
    ))


#: The most steps one /submit_steps may carry, and the largest step index accepted (token ids: the tokenizer's
#: ``id_bound``).
MAX_SUBMITTED_STEPS = 4096
_MAX_INT32 = 2**31 - 1
#: The largest 32-bit float: logprobs are kept as such.
_F32 = 3.4028234663852886e38


def _token_ids(ids: list[int], name: str, bound: int) -> None:
    """400 naming the first entry that is not a token id of the model (below ``bound``, the tokenizer's
    ``id_bound``): an engine would be asked to embed it, or a trainer to train on it."""
    bad = next((i for i, token in enumerate(ids) if not 0 <= token < bound), None)
    if bad is not None:
        raise BadRequest(f"'{name}[{bad}]' is not a token id of the model (ids are 0 to {bound - 1}), "
                         f"got {ids[bad]}", param=f"{name}[{bad}]")


def _submitted(body: SubmitStepsBody, id_bound: int) -> dict[str, list[SubmittedStep]]:
    """The steps by trajectory (in step order), after every check that needs no session (400 naming the field)."""
    if not body.steps:
        raise BadRequest("'steps' must hold at least one step", param="steps")
    if len(body.steps) > MAX_SUBMITTED_STEPS:
        raise BadRequest(f"at most {MAX_SUBMITTED_STEPS} steps per request", param="steps")
    by_trajectory: dict[str, list[SubmittedStep]] = {}
    for position, step in enumerate(body.steps):
        where = f"steps[{position}]"
        for unsupported in ("routed_experts", "multi_modal_data"):
            if getattr(step, unsupported):
                raise BadRequest(f"'{where}.{unsupported}' is not supported (send null): the proxy records routed "
                                 "experts itself (--use-rollout-routing-replay) and serves text models",
                                 param=f"{where}.{unsupported}")
        uid = _uid(step.trajectory_uid, f"{where}.trajectory_uid")
        prompt_uid = _uid(step.prompt_uid, f"{where}.prompt_uid")
        if not 0 <= step.step_index <= _MAX_INT32:
            raise BadRequest(f"'{where}.step_index' must be a non-negative integer", param=f"{where}.step_index")
        for kind in ("prompt_ids", "response_ids"):
            _token_ids(getattr(step, kind), f"{where}.{kind}", id_bound)
        logprobs = step.rollout_log_probs
        if logprobs is not None and len(logprobs) != len(step.response_ids):
            raise BadRequest(f"'{where}.rollout_log_probs' has {len(logprobs)} values for {len(step.response_ids)} "
                             "response ids", param=f"{where}.rollout_log_probs")
        far = None if logprobs is None else next((i for i, v in enumerate(logprobs) if not -_F32 <= v <= _F32), None)
        if far is not None:  # kept as 32-bit floats: it would be infinite there, and null in the trainer's JSON
            raise BadRequest(f"'{where}.rollout_log_probs[{far}]' is past a 32-bit float's range",
                             param=f"{where}.rollout_log_probs[{far}]")
        steps = by_trajectory.setdefault(uid, [])
        if any(s.step_index == step.step_index for s in steps):
            raise BadRequest(f"step {step.step_index} of trajectory {uid!r} is submitted twice",
                             param=f"{where}.step_index")
        if steps and steps[0].prompt_uid != prompt_uid:
            raise BadRequest(f"trajectory {uid!r} is submitted with two prompt_uids", param=f"{where}.prompt_uid")
        steps.append(SubmittedStep(position, prompt_uid, step.step_index, array("i", step.prompt_ids),
                                   array("i", step.response_ids), step.reward, step.policy_version, step.is_last,
                                   dict(step.metadata or {}),
                                   None if logprobs is None else array("f", logprobs)))
    for uid, steps in by_trajectory.items():
        steps.sort(key=lambda s: s.step_index)
        last = [s for s in steps if s.is_last]
        if last and (len(last) > 1 or last[0] is not steps[-1]):
            raise BadRequest(f"'is_last' must be set only on the last submitted step of trajectory {uid!r}",
                             param=f"steps[{last[0].position}].is_last")
    return by_trajectory


async def generate_tokens_in(runtime: Runtime, gateway: Gateway, body: TokenGenerateBody,
                             early: EarlyStart | None = None) -> bytes:
    """``POST /generate {prompt_ids, sampling_params}``: generate from exactly these ids (no template).

    The step waits for the ``/submit_steps`` that names its trajectory (:mod:`~actorproxy.runtime.token_in`).
    The client gets a ``102 Processing`` each ``--heartbeat-interval`` until the step is generated, when it
    takes one (``early``).
    """
    params = body.sampling_params
    if body.image_data or body.video_data:
        raise BadRequest("images and videos are not supported: the proxy serves text models",
                         param="image_data" if body.image_data else "video_data")
    if params.repetition_penalty is not None and not 0.0 < params.repetition_penalty <= 2.0:
        raise BadRequest("'sampling_params.repetition_penalty' must be in (0, 2]",
                         param="sampling_params.repetition_penalty")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise BadRequest("'sampling_params.max_tokens' must be at least 1", param="sampling_params.max_tokens")
    if params.temperature is not None and not 0.0 <= params.temperature <= 2.0:
        raise BadRequest("'sampling_params.temperature' must be between 0 and 2", param="sampling_params.temperature")
    if params.top_p is not None and not 0.0 < params.top_p <= 1.0:
        raise BadRequest("'sampling_params.top_p' must be in (0, 1]", param="sampling_params.top_p")
    if not body.prompt_ids:
        raise BadRequest("'prompt_ids' must hold at least one token id", param="prompt_ids")
    _token_ids(body.prompt_ids, "prompt_ids", runtime.tokenizer.id_bound)
    await store_unclaimed(runtime, gateway.generations, gateway.generations.expired())
    step = await generate_tokens(runtime, array("i", body.prompt_ids), max_new_tokens=params.max_tokens,
                                 temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                                 extras=sampling_extras(repetition_penalty=params.repetition_penalty),
                                 waiting=still_working(early))
    gateway.generations.add(step)
    reason = step.finish_reason or "stop"
    return orjson.dumps(CONVERTER.unstructure(TokenGenerateResult(
        token_ids=step.output_ids.tolist(),
        log_probs=step.output_logprobs.tolist() if params.logprobs else None,
        stop_reason="stop" if reason == "abort" else reason,
        versions=step.output_versions.tolist(),
        weight_version=step.weight_version,
    )))


async def generate_turn(runtime: Runtime, gateway: Gateway, raw: bytes, client: str | None = None,
                        early: EarlyStart | None = None) -> bytes:
    """``POST /generate``: one turn of session ``trajectory_uid`` in prompt group ``prompt_uid``, ids and all.

    A body with ``prompt_ids`` (the Claw-R1 gateway's flows) is a token-in generation instead. Either's
    client gets a ``102 Processing`` each ``--heartbeat-interval`` it waits, when it takes one (``early``).
    """
    parsed = jsonio.loads(raw)
    if isinstance(parsed, dict) and "prompt_ids" in parsed:
        return await generate_tokens_in(runtime, gateway, structure(parsed, TokenGenerateBody), early)
    body: GenerateBody = structure(parsed, GenerateBody)
    trajectory_uid, prompt_uid = _uid(body.trajectory_uid, "trajectory_uid"), _uid(body.prompt_uid, "prompt_uid")
    chat = {k: v for k, v in attrs.asdict(body, recurse=False).items() if v is not None}
    call = parse_chat_body(chat)  # the same message, tool and sampling checks as chat completions
    identity = Identity(session_id=trajectory_uid, instance_id=prompt_uid, client=client)
    events = await runtime.start_turn(call.request, identity, still_working(early))
    with events:
        done: TurnDone | None = None
        async for event in events:
            if isinstance(event, TurnDone):
                done = event
            elif hasattr(event, "error"):
                raise event.error
        if done is None or done.ids is None:
            raise BadRequest("the turn ended without a result")
    gateway.trajectories.setdefault(trajectory_uid, Trajectory(prompt_uid))
    ids = done.ids
    output = done.output
    message = output_as_message(output)
    return orjson.dumps(CONVERTER.unstructure(GenerateResult(
        trajectory_uid=trajectory_uid,
        prompt_uid=prompt_uid,
        response_text=output.content or "",
        response_ids=ids.output_ids.tolist(),
        prompt_ids=ids.prompt_ids.tolist(),
        logprobs=ids.output_logprobs.tolist(),
        versions=ids.output_versions.tolist(),
        finish_reason=done.finish_reason,
        step_index=done.step_index,
        tool_calls=message.get("tool_calls", []),
        reasoning_content=output.reasoning or None,
    )))
