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
import uuid
from collections import OrderedDict
from typing import Any, Literal

import attrs
import orjson
import trio
from quart import Response, g, request
from quart_trio import QuartTrio

from ..core.messages import output_as_message
from ..errors import BadRequest, NotConfigured, NotFound, RewardFailed, RewardTimeout, Unauthorized
from ..rewards import RewardFunctionError, as_reward, is_async, load_reward_fn
from ..runtime.handoff import Group, GroupHandoff
from ..runtime.messages import Identity, TurnDone
from ..runtime.runtime import Runtime
from ..runtime.store import encode_body
from ..wire import jsonio
from ..wire.converter import ours, structure
from ..wire.openai_chat import parse_chat_body
from .auth import AccessPolicy
from .identity import MAX_ID_LENGTH

log = logging.getLogger(__name__)

Channel = Literal["train", "validate"]
#: Trajectories whose channel and metadata are remembered (oldest forgotten first).
_TRAJECTORY_MEMORY = 100_000
#: The longest a fetch_batch call may wait.
MAX_FETCH_WAIT = 600.0


# -- bodies -------------------------------------------------------------------------------


@ours
@attrs.frozen
class GenerateBody:
    trajectory_uid: str
    prompt_uid: str
    messages: list[Any]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    #: A string or a list of strings (checked as chat completions check it).
    stop: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


@ours
@attrs.frozen
class InitBody:
    prompt_uid: str | None = None
    channel: Channel = "train"
    metadata: dict[str, Any] = attrs.field(factory=dict)


@ours
@attrs.frozen
class RegisterBody:
    channel: Channel = "train"
    metadata: dict[str, Any] = attrs.field(factory=dict)


@ours
@attrs.frozen
class CompleteBody:
    reward: float | None = None
    channel: Channel | None = None


@ours
@attrs.frozen
class RewardBody:
    trajectory_uid: str
    messages: list[Any]
    dataset_fields: dict[str, Any] = attrs.field(factory=dict)


@ours
@attrs.frozen
class FetchBatchBody:
    groups: int
    rollouts_per_group: int
    timeout_s: float = 30.0


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


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status=status, mimetype="application/json")


# -- state --------------------------------------------------------------------------------


@attrs.define
class Trajectory:
    prompt_uid: str
    channel: Channel = "train"
    metadata: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class Gateway:
    """What the gateway remembers: trajectories' channels and metadata, and the hand-off."""

    handoff: GroupHandoff
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
    gateway = Gateway(GroupHandoff(max_pending_groups=settings.max_pending_groups))
    reward_fn = load_reward_fn(settings.reward_fn) if settings.reward_fn else None
    reward_threads = trio.CapacityLimiter(4)

    def base_url(trajectory_uid: str, prompt_uid: str) -> str:
        root = settings.advertise_url or request.host_url
        return f"{root.rstrip('/')}/{trajectory_uid}/{prompt_uid}"

    @app.get("/ready")
    async def ready() -> Response:
        if not await runtime.backend_healthy():
            return _json({"detail": "not ready: no inference engine is healthy yet"}, 503)
        return _json({"status": "ready"})

    @app.post("/generate")
    async def generate() -> Response:
        body: GenerateBody = await _body(GenerateBody)
        trajectory_uid, prompt_uid = _uid(body.trajectory_uid, "trajectory_uid"), _uid(body.prompt_uid, "prompt_uid")
        chat = {k: v for k, v in attrs.asdict(body, recurse=False).items() if v is not None}
        call = parse_chat_body(chat)  # the same message, tool and sampling checks as chat completions
        identity = Identity(session_id=trajectory_uid, instance_id=prompt_uid)
        events = await runtime.start_turn(call.request, identity)
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
        return _json({
            "trajectory_uid": trajectory_uid,
            "prompt_uid": prompt_uid,
            "response_text": output.content or "",
            "response_ids": ids.output_ids.tolist(),
            "prompt_ids": ids.prompt_ids.tolist(),
            "logprobs": ids.output_logprobs.tolist(),
            "versions": ids.output_versions.tolist(),
            "finish_reason": done.finish_reason,
            "step_index": done.step_index,
            "tool_calls": message.get("tool_calls", []),
            "reasoning_content": output.reasoning or None,
        })

    @app.post("/init_trajectory")
    async def init_trajectory() -> Response:
        body: InitBody = await _body(InitBody, optional=True)
        trajectory_uid = uuid.uuid4().hex
        prompt_uid = _uid(body.prompt_uid, "prompt_uid") if body.prompt_uid is not None else uuid.uuid4().hex
        gateway.remember(trajectory_uid, Trajectory(prompt_uid, body.channel, dict(body.metadata)))
        key = policy.session_key(trajectory_uid) if policy.agent_auth == "session-key" else None
        return _json({
            "trajectory_uid": trajectory_uid,
            "prompt_uid": prompt_uid,
            "channel": body.channel,
            "base_url": base_url(trajectory_uid, prompt_uid),
            "api_key": key,
        })

    @app.post("/<url_session>/<url_instance>/v1/register_trajectory")
    async def register_trajectory(url_session: str, url_instance: str) -> Response:
        _confined(url_session)
        body: RegisterBody = await _body(RegisterBody, optional=True)
        trajectory = gateway.remember(
            _uid(url_session, "trajectory_uid"), Trajectory(_uid(url_instance, "prompt_uid"), body.channel,
                                                            dict(body.metadata))
        )
        return _json({"status": "ok", "trajectory_uid": url_session, "prompt_uid": trajectory.prompt_uid,
                      "channel": trajectory.channel})

    async def complete(trajectory_uid: str, prompt_uid: str | None, body: CompleteBody) -> Response:
        known = gateway.trajectories.pop(trajectory_uid, None)
        channel = body.channel or (known.channel if known else "train")
        instance = prompt_uid or (known.prompt_uid if known else None)
        result = await runtime.finalize(trajectory_uid, reward=body.reward, instance_id=instance)
        queued = False
        if channel == "train" and instance is not None and result.get("segments", 0):
            queued = gateway.handoff.complete(trajectory_uid, instance, body.reward)
        return _json({"status": "ok", "trajectory_uid": trajectory_uid, "prompt_uid": instance, "channel": channel,
                      "queued_for_training": queued, **{k: result[k] for k in ("segments", "steps") if k in result}})

    @app.post("/<url_session>/<url_instance>/v1/complete_trajectory")
    async def complete_under_base_url(url_session: str, url_instance: str) -> Response:
        _confined(url_session)
        body: CompleteBody = await _body(CompleteBody, optional=True)
        if body.reward is not None and g.get("agent_session") is not None:
            raise Unauthorized(
                "a reward needs the admin token: an agent cannot grade itself", code="admin_token_required"
            )
        return await complete(_uid(url_session, "trajectory_uid"), _uid(url_instance, "prompt_uid"), body)

    @app.post("/complete_trajectory/<trajectory_uid>")
    async def complete_by_id(trajectory_uid: str) -> Response:
        body: CompleteBody = await _body(CompleteBody, optional=True)
        return await complete(_uid(trajectory_uid, "trajectory_uid"), None, body)

    @app.post("/compute_reward")
    async def compute_reward() -> Response:
        body: RewardBody = await _body(RewardBody)
        if reward_fn is None:
            raise NotConfigured(
                "no reward function: start the proxy with --reward-fn module:callable (or a shipped one: "
                "--reward-fn gsm8k, --reward-fn exact_match)"
            )
        name, fn = reward_fn
        messages, fields = list(body.messages), dict(body.dataset_fields)
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
            reward = as_reward(name, value)
        except RewardFunctionError as exc:
            raise RewardFailed(str(exc)) from None
        return _json({"trajectory_uid": body.trajectory_uid, "reward": reward})

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
                    return await hand_over(groups, complete_)
            # Another trainer took groups this call waited for: wait again until the deadline.

    async def hand_over(groups: list[Group], complete_: bool) -> Response:
        """Read, serialise, and only then drain: a reply that cannot be built loses nothing."""
        data = []
        read: dict[str, set[str]] = {}
        for group in groups:
            trajectories = []
            for item in group.trajectories:
                try:
                    segments = (await runtime.read(session_id=item.trajectory_id)).get("data", [])
                except NotFound:
                    segments = []  # already read (drained) with /trajectory/read
                read[item.trajectory_id] = {s["trajectory_id"] for s in segments}
                trajectories.append({"trajectory_id": item.trajectory_id, "reward": item.reward,
                                     "segments": segments})
            data.append({"instance_id": group.instance_id, "trajectories": trajectories})
        reply = encode_body({"data": data, "complete": complete_})
        for trajectory_id, segment_ids in read.items():
            if not segment_ids:
                continue
            drained = await runtime.read(session_id=trajectory_id, drain=True)
            late = {s["trajectory_id"] for s in drained.get("data", [])} - segment_ids
            if late:
                log.error("fetch_batch: segments %s of %s were stored while its batch was built and were drained "
                          "with it without being handed over", sorted(late), trajectory_id)
        gateway.handoff.remove(groups)
        return Response(reply, mimetype="application/json")

    return gateway


def _confined(trajectory_uid: str) -> None:
    """An agent holding a session key may touch only its own trajectory."""
    confined = g.get("agent_session")
    if confined is not None and confined != trajectory_uid:
        raise Unauthorized("this API key belongs to another trajectory", code="wrong_session")

