"""`ProxyClient`: the async client rollout code uses to talk to actorproxy (httpx, Trio-friendly).

The gateway methods (``generate``, ``submit_steps``, ``compute_reward``,
``init_trajectory``, ``complete_trajectory``, ``fetch_batch``) return typed
attrs results, structured by the wire converter from the same models the
proxy's routes use (:mod:`actorproxy.protocols.gateway_models`); ``read_segments``
returns typed segments (:class:`~actorproxy.core.records.Segment`) the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar

import httpx

from .core.records import Segment
from .protocols.gateway_models import (
    Channel,
    CompleteResult,
    FetchBatchResult,
    GenerateResult,
    InitResult,
    RewardResult,
    StepBody,
    SubmitStepsResult,
)
from .schema.converter import CONVERTER
from .trajectory_file import load_trajectory_file as load_trajectory_file

__all__ = [
    "CompleteResult", "FetchBatchResult", "GenerateResult", "InitResult", "ProxyClient", "ProxyError", "RewardResult",
    "Segment", "StepBody", "SubmitStepsResult", "load_trajectory_file",
]

T = TypeVar("T")


class ProxyError(Exception):
    """The proxy answered with an error: ``status``, ``code`` and the message it sent."""

    def __init__(self, status: int, code: str | None, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body


class ProxyClient:
    """Async client for one proxy.

    Use it from Trio (or asyncio) code, ideally as ``async with ProxyClient(url) as client``
    so its connection pool is closed; ``aclose()`` does the same.
    """

    def __init__(
        self,
        proxy_url: str = "http://127.0.0.1:8800",
        *,
        timeout: float | None = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        admin_token: str | None = None,
    ) -> None:
        """``admin_token``: the proxy's ``--admin-token``, sent as ``Authorization: Bearer`` on every call
        (needed for the trainer's routes of a proxy that has one; docs/security.md)."""
        self.proxy_url = proxy_url.rstrip("/")
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
        self._http = httpx.AsyncClient(base_url=self.proxy_url, timeout=timeout, transport=transport, headers=headers)

    async def __aenter__(self) -> ProxyClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        response = await self._http.post(path, json=body, headers=headers)
        return _unwrap(response)

    async def chat_completions(
        self,
        body: dict[str, Any],
        *,
        session_id: str,
        instance_id: str | None = None,
        turn_id: str | None = None,
    ) -> dict[str, Any]:
        """One non-streaming ``/v1/chat/completions`` call in ``session_id``; returns the JSON reply."""
        headers = {"X-Session-Id": session_id}
        if instance_id:
            headers["X-Instance-Id"] = instance_id
        if turn_id:
            headers["X-Turn-Id"] = turn_id
        return dict(await self._post("/v1/chat/completions", {**body, "stream": False}, headers))

    async def finalize_session(
        self, session_id: str, *, instance_id: str | None = None, reward: float | None = None
    ) -> dict[str, Any]:
        """Close the session's open segment so the trainer can read it."""
        body = {"session_id": session_id, **_given(instance_id=instance_id, reward=reward)}
        return dict(await self._post("/session/finalize", body))

    async def read_trajectory(
        self,
        *,
        session_id: str | None = None,
        trajectory_id: str | None = None,
        drain: bool = False,
        include_steps: bool = False,
        lease: float | None = None,
    ) -> dict[str, Any]:
        """Finalized segments (``{"data": [...]}``); ``drain=True`` removes them from the store.

        ``lease`` (seconds, with ``drain``): nothing is removed until :meth:`acknowledge` is called with the
        reply's ``lease["id"]``; without it in time, the next drain reads them again (:meth:`leased_drain`).
        """
        body = {"drain": drain, "include_steps": include_steps,
                **_given(session_id=session_id, trajectory_id=trajectory_id, lease=lease)}
        return dict(await self._post("/trajectory/read", body))

    async def acknowledge(self, lease: str, *, release: bool = False) -> dict[str, Any]:
        """A leased drain's data is safe with the trainer: removed from the store (``release=True``: given back,
        for the next drain); the answer's ``status`` says which it was (``"repeated": true``: this lease was
        settled before, and ``status`` says how).

        An acknowledgement is idempotent, so one whose answer is lost on the way (a transport error) is sent once
        more. :class:`ProxyError` 410 ``lease_expired`` if its lease ended first (given back: it comes again in a
        later drain), 404 ``unknown_lease`` for a lease the proxy never made or no longer remembers."""
        body = {"lease": lease, **_given(release=release or None)}
        try:
            return dict(await self._post("/trajectory/ack", body))
        except httpx.TransportError:
            return dict(await self._post("/trajectory/ack", body))

    @asynccontextmanager
    async def leased_drain(
        self, *, lease: float = 300.0, session_id: str | None = None, include_steps: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """A drain whose data leaves the store only once the block ends without an error.

        The block gets the read (``{"data": [...], "lease": {...}}``). Ending normally acknowledges it
        (removed); an exception gives it back at once, for the next drain; a trainer that dies inside
        the block loses nothing either: after ``lease`` seconds the next drain reads it again.
        """
        read = await self.read_trajectory(session_id=session_id, drain=True, include_steps=include_steps,
                                          lease=lease)
        try:
            yield read
        except BaseException:
            with contextlib.suppress(ProxyError, httpx.HTTPError):  # (its lease ends anyway)
                await self.acknowledge(read["lease"]["id"], release=True)
            raise
        await self.acknowledge(read["lease"]["id"])

    async def read_segments(
        self, *, session_id: str | None = None, trajectory_id: str | None = None, drain: bool = False
    ) -> list[Segment]:
        """The finalized segments, typed (arrays as ``array``), structured by the proxy's own converter.

        The same data as :meth:`read_trajectory`'s ``data``; the derived counts
        (``num_tokens``, ``num_trained_tokens``) are properties of the segment.
        """
        payload = await self.read_trajectory(session_id=session_id, trajectory_id=trajectory_id, drain=drain)
        return CONVERTER.structure(payload["data"], list[Segment])

    # -- the gateway (docs/gateway.md) ------------------------------------------------------

    async def _typed(self, path: str, body: dict[str, Any], kind: type[T]) -> T:
        return CONVERTER.structure(await self._post(path, body), kind)

    async def generate(
        self,
        trajectory_uid: str,
        prompt_uid: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        stop: str | list[str] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """One white-box turn (``POST /generate``): the exact ids the engine was given and sampled."""
        body = {"trajectory_uid": trajectory_uid, "prompt_uid": prompt_uid, "messages": [dict(m) for m in messages],
                **_given(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop,
                         tools=[dict(t) for t in tools] if tools is not None else None,
                         chat_template_kwargs=dict(chat_template_kwargs) if chat_template_kwargs is not None else None)}
        return await self._typed("/generate", body, GenerateResult)

    async def submit_steps(self, steps: Sequence[StepBody | Mapping[str, Any]]) -> SubmitStepsResult:
        """Attach rewards and metadata to recorded steps, or store external ones (``POST /submit_steps``).

        All or nothing: a step whose ids differ from the recorded ones raises :class:`ProxyError` 409
        naming the first differing position, and nothing is applied.
        """
        wire = [CONVERTER.unstructure(s) if isinstance(s, StepBody) else dict(s) for s in steps]
        return await self._typed("/submit_steps", {"steps": wire}, SubmitStepsResult)

    async def compute_reward(
        self,
        trajectory_uid: str,
        messages: Sequence[Mapping[str, Any]],
        dataset_fields: Mapping[str, Any] | None = None,
    ) -> RewardResult:
        """The reward of a conversation by the proxy's ``--reward-fn`` (``POST /compute_reward``)."""
        body = {"trajectory_uid": trajectory_uid, "messages": [dict(m) for m in messages],
                "dataset_fields": dict(dataset_fields or {})}
        return await self._typed("/compute_reward", body, RewardResult)

    async def init_trajectory(
        self, *, prompt_uid: str | None = None, channel: Channel = "train", metadata: Mapping[str, Any] | None = None
    ) -> InitResult:
        """A new trajectory and the ``base_url`` a black-box agent uses (``POST /init_trajectory``)."""
        body = {"channel": channel, "metadata": dict(metadata or {}), **_given(prompt_uid=prompt_uid)}
        return await self._typed("/init_trajectory", body, InitResult)

    async def complete_trajectory(
        self, trajectory_uid: str, *, reward: float | None = None, channel: Channel | None = None
    ) -> CompleteResult:
        """Finalize a trajectory; on the train channel it is queued for ``fetch_batch``."""
        body = _given(reward=reward, channel=channel)
        return await self._typed(f"/complete_trajectory/{trajectory_uid}", body, CompleteResult)

    async def fetch_batch(self, groups: int, rollouts_per_group: int, *, timeout_s: float = 30.0,
                          lease: float | None = None) -> FetchBatchResult:
        """Wait for ``groups`` complete prompt groups of ``rollouts_per_group`` and take them (drained).

        ``lease`` (seconds): removed from the store only once :meth:`acknowledge` is called with the result's
        ``lease.id``; without it in time, its groups are handed out again, first.
        """
        body = {"groups": groups, "rollouts_per_group": rollouts_per_group, "timeout_s": timeout_s,
                **_given(lease=lease)}
        return await self._typed("/trajectory/fetch_batch", body, FetchBatchResult)

    async def stats(self) -> dict[str, Any]:
        return dict(_unwrap(await self._http.get("/trajectory/stats")))

    async def health(self) -> dict[str, Any]:
        return dict(_unwrap(await self._http.get("/health")))


def _given(**fields: Any) -> dict[str, Any]:
    """The fields that are not ``None``: an optional field left out of a body is absent, not null."""
    return {name: value for name, value in fields.items() if value is not None}


def _unwrap(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.is_success:
        return body
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        raise ProxyError(response.status_code, error.get("code"), str(error.get("message")), body)
    raise ProxyError(response.status_code, None, response.text[:500], body)
