"""Start-up checks with one-line answers: every failure names the flag and the fix.

``actorproxy run`` runs them before serving, ``actorproxy check`` runs them and
exits. A failure is a :class:`StartupError`; ``main`` prints it as one line and
exits with status 2 (no exception groups, no hub tracebacks).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator

import trio

from .config import ProxyConfig
from .engines.base import BackendError, ModelInfo
from .engines.engine_check import check_engine_tokenizer
from .errors import ShutdownError, StartupError
from .runtime.backends import make_backend, wait_for_engine
from .serve import bind_host
from .tokenization.tokenizer import ChatTokenizer, load_tokenizer


def _reason(exc: BaseException) -> str:
    """The gist of an exception: its last non-empty line, shortened."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def load_tokenizer_checked(path: str | None) -> ChatTokenizer:
    """The tokenizer ``--tokenizer-path`` names, or a one-line :class:`StartupError`."""
    if path is not None and path != "qwen3" and not os.path.exists(path):
        raise StartupError(
            "--tokenizer-path",
            f"{path} does not exist; give a Hugging Face tokenizer directory (tokenizer.json and a chat template) "
            "or a .gguf file, or leave the flag out for the built-in qwen3",
        )
    try:
        return load_tokenizer(path)
    except Exception as exc:  # transformers raises many kinds (OSError, ValueError, hub errors)
        raise StartupError(
            "--tokenizer-path",
            f"cannot load a tokenizer from {path!r} ({_reason(exc)}); give a Hugging Face tokenizer directory "
            "(tokenizer.json and a chat template) or a .gguf file, or leave the flag out for the built-in qwen3",
        ) from None


def check_port(host: str, port: int) -> None:
    """Refuse a port another process holds (``0`` always works)."""
    if port == 0:
        return
    address = bind_host(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(
                    "--port", f"{address}:{port} is already in use (another actorproxy?); pick another --port, "
                    "or --port 0 for a free one"
                ) from None
            raise StartupError("--host", f"cannot listen on {address}:{port}: {exc.strerror or exc}") from None


def engine_error(config: ProxyConfig, exc: BackendError) -> StartupError:
    """An engine that did not answer at start, as the flag to check."""
    urls = ", ".join(config.engines.backend_urls) or "the built-in simulator"
    return StartupError(
        "--backend-url",
        f"{_reason(exc)} (engines: {urls}); check the engine is up and the URL, or raise --engine-startup-timeout",
    )


def startup_failure(exc: BaseException, config: ProxyConfig) -> StartupError | None:
    """The first start-up failure inside ``exc`` (exception groups included), as one line."""
    for inner in _leaves(exc):
        if isinstance(inner, StartupError):
            return inner
        if isinstance(inner, BackendError):
            return engine_error(config, inner)
        if isinstance(inner, OSError) and inner.errno == errno.EADDRINUSE:
            return StartupError("--port", f"port {config.server.port} is already in use; pick another --port")
    return None


def shutdown_failure(exc: BaseException) -> ShutdownError | None:
    """The :class:`ShutdownError` inside ``exc`` (exception groups included), if any."""
    return next((inner for inner in _leaves(exc) if isinstance(inner, ShutdownError)), None)


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


async def probe_engines(config: ProxyConfig, tokenizer: ChatTokenizer) -> ModelInfo:
    """Ask the configured engines for their model info, within ``--engine-startup-timeout``,
    and check that they tokenize as ``tokenizer`` (engines/engine_check.py)."""
    engine = make_backend(config, tokenizer)
    info: ModelInfo | None = None
    try:
        with trio.move_on_after(config.engines.engine_startup_timeout):
            info = await wait_for_engine(engine)
        if info is not None:
            if not config.engines.skip_tokenizer_check:
                await check_engine_tokenizer(tokenizer, engine)
            return info
        raise engine_error(
            config, BackendError(f"no engine answered within {config.engines.engine_startup_timeout:g} s")
        )
    finally:
        await engine.aclose()
