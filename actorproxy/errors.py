"""The proxy's error types.

Every error that reaches a caller is a :class:`ProxyError`: it carries the HTTP
status, a stable machine-readable ``code`` and the offending ``param``. The
ingress turns it into the caller's own format (OpenAI ``{"error": {...}}``,
Anthropic ``{"type": "error", ...}``); nothing else becomes a response body.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ProxyError(Exception):
    """An error with an HTTP status and a stable code, shown to the caller."""

    status: ClassVar[int] = 400
    default_code: ClassVar[str] = "invalid_request"
    #: OpenAI's ``error.type`` for this kind of error.
    openai_type: ClassVar[str] = "invalid_request_error"
    #: The ``Retry-After`` seconds this kind of error says unless its raiser sets another.
    default_retry_after: ClassVar[float | None] = None

    def __init_subclass__(
        cls, *, status: int | None = None, code: str | None = None, openai_type: str | None = None, **kwargs: Any
    ) -> None:
        """A subclass names what differs from its base: ``class NotFound(ProxyError, status=404, code=...)``."""
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if code is not None:
            cls.default_code = code
        if openai_type is not None:
            cls.openai_type = openai_type

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        #: Seconds a client should wait before retrying (sent as ``Retry-After``).
        self.retry_after: float | None = self.default_retry_after

    @property
    def anthropic_message(self) -> str:
        """The message on Anthropic's routes (where it is the only field a client reads)."""
        return self.message

    def to_openai(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(ProxyError):
    """Malformed JSON, a missing field, a value out of range."""


class ContextOverflow(ProxyError, code="context_overflow"):
    """The prompt does not fit the context window, or is longer than ``--max-prompt-tokens``.

    Worded as the APIs word it, since agent clients read the message to tell an overflow from
    another 400 and then compact their history: OpenAI's "maximum context length is N tokens"
    (Claude Code, opencode and LiteLLM look for it) and, on Anthropic's routes, Anthropic's
    "prompt is too long: N tokens > M maximum" (Claude Code reads the two numbers). The code
    stays ``context_overflow``. ``details``: the numbers, for Dressage's error shape.
    """

    def __init__(self, prompt_tokens: int, *, window: int, max_prompt_tokens: int | None = None,
                 param: str | None = None, details: dict[str, object] | None = None) -> None:
        if max_prompt_tokens is not None:
            message = (f"This model's maximum prompt length is {max_prompt_tokens} tokens (--max-prompt-tokens). "
                       f"However, your prompt is {prompt_tokens} tokens. Please reduce the length of the messages.")
            most = max_prompt_tokens
        else:
            message = (f"This model's maximum context length is {window} tokens. However, your prompt is "
                       f"{prompt_tokens} tokens, which leaves no room for a completion. Please reduce the length "
                       "of the messages.")
            most = window - 1  # a prompt must leave the window room for one token
        super().__init__(message, param=param)
        self._anthropic = f"prompt is too long: {prompt_tokens} tokens > {most} maximum"
        self.details: dict[str, object] = dict(details or {})

    @property
    def anthropic_message(self) -> str:
        return self._anthropic


class StepLimitExceeded(ProxyError, code="max_steps_exceeded"):
    """The session already holds ``--max-steps-per-session`` steps."""


class Unauthorized(ProxyError, status=401, code="unauthorized", openai_type="authentication_error"):
    """Missing or wrong credentials: the admin token, a session key or the API key."""


class NotFound(ProxyError, status=404, code="not_found", openai_type="not_found_error"):
    """What the request names does not exist."""


class Conflict(ProxyError, status=409, code="conflict"):
    """The request contradicts the state it acts on."""


class Gone(ProxyError, status=410, code="gone", openai_type="not_found_error"):
    """What the request names existed and ended, for good (a lease not acknowledged in time)."""


class Overloaded(ProxyError, status=503, code="overloaded", openai_type="server_error"):
    """Too many sessions or a full queue; the caller should retry later (``Retry-After: 1`` unless set)."""

    default_retry_after = 1.0


class TooManySessions(Overloaded, status=429, code="too_many_sessions", openai_type="rate_limit_error"):
    """The client holds its share of the live sessions (``--max-sessions-per-client``, or its fair share at
    ``--max-sessions``) and none of its own is idle: another client's session is not taken for it."""


class TooManyLeases(ProxyError, status=429, code="too_many_leases", openai_type="rate_limit_error"):
    """The trainer holds ``MAX_LEASES`` leased drains it has not acknowledged: another waits for one of them."""


class StorageFull(ProxyError, status=507, code="insufficient_storage", openai_type="server_error"):
    """The data could not be written where it was asked to go (disk full, no permission)."""


class NotConfigured(ProxyError, status=501, code="not_configured"):
    """The route needs a setting that was not given (``/compute_reward`` without ``--reward-fn``)."""


class RewardFailed(ProxyError, status=422, code="reward_function_failed"):
    """The user's reward function raised or returned no finite number."""


class RewardTimeout(ProxyError, status=504, code="reward_timeout", openai_type="server_error"):
    """The user's reward function took longer than ``--reward-timeout``."""


class EngineError(ProxyError, status=502, code="engine_error", openai_type="server_error"):
    """The inference engine failed or returned something unusable."""


class EngineTimeout(EngineError, status=504, code="engine_timeout"):
    """The inference engine did not answer in time."""


class ShuttingDown(Overloaded, code="shutting_down"):
    """The proxy is draining to stop: new turns are refused."""


class FlagError(Exception):
    """A one-line reason that names the flag concerned: ``--flag: message``."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class StartupError(FlagError):
    """Why the proxy cannot start, as one line that names the flag to change (``main`` prints it, exit 2)."""


class ShutdownError(FlagError):
    """Why the proxy could not stop cleanly, as one line naming the flag concerned (``main`` prints it, exit 1)."""


def release(error: BaseException) -> None:
    """Drop the tracebacks of ``error``, its causes and its group's members, once it is answered.

    A traceback holds its frames and their locals: the request body among them. Where
    a frame also holds the exception (cattrs collects each field's error in a list of
    its own frame, then raises them as a group), exception, traceback and frame form
    a cycle that only the cyclic collector frees, and a refused 20 MB body stayed in
    memory until it ran. Without the tracebacks, a refusal is freed as soon as it is
    answered. Call it after the error is logged.
    """
    pending: list[BaseException] = [error]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        item.__traceback__ = None
        pending.extend(e for e in (item.__context__, item.__cause__) if e is not None)
        if isinstance(item, BaseExceptionGroup):
            pending.extend(item.exceptions)
