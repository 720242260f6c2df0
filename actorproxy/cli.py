"""``actorproxy`` command line: ``actorproxy run [flags]``, ``actorproxy sim [flags]``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from functools import partial

import attrs
import trio

from . import __version__
from .compat import add_compat_arguments, apply_compat, check_engine
from .config import ProxyConfig
from .config.sim_engine import SimConfig
from .errors import StartupError
from .logs import configure_logging
from .reward_worker import RayRewardWorker
from .runtime import freed_memory
from .serve import RunningProxy, serve_until_signal
from .server.auth import exposure_problem
from .settings_cli import add_settings_arguments, build_config, settings_from_namespace
from .sim.server import RunningSim, SimServerSettings, serve_sim, served_engine
from .startup import check_port, load_tokenizer_checked, probe_engines, shutdown_failure, startup_failure
from .store.ray_pool import check_pool, exit_after_ray
from .tokenization.tokenizer import ChatTokenizer
from .workers.supervisor import serve_workers


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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it says something (not ``None``, not for on/off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="actorproxy",
        description="An exact-token inference proxy for agentic RL.",
    )
    parser.add_argument("--version", action="version", version=f"actorproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="serve the proxy",
        description=(
            "Serve the OpenAI-compatible proxy. Agents call /v1/chat/completions with an "
            "X-Session-Id header; the trainer reads finalized segments from /trajectory/read. "
            "With no flags: 127.0.0.1:8800, the built-in qwen3 tokenizer, the simulated engine."
        ),
        formatter_class=_HelpFormatter,
    )
    add_compat_arguments(add_settings_arguments(run))
    check = commands.add_parser(
        "check",
        help="run the start-up checks of 'run' with the same flags, then exit",
        description=(
            "Check what 'actorproxy run' with these flags would need: the settings, the tokenizer, the port, "
            "the access settings and the engines (reachable, and serving a model whose tokenizer is ours). "
            "Prints one line per check; exits 0 when all pass, 2 otherwise."
        ),
        formatter_class=_HelpFormatter,
    )
    add_compat_arguments(add_settings_arguments(check))
    _add_sim_parser(commands)
    return parser


def _add_sim_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = SimServerSettings()
    e = d.engine
    sim = commands.add_parser(
        "sim",
        help="serve a simulated inference engine (SGLang, vLLM and llama.cpp APIs)",
        description=(
            "Serve the deterministic simulated engine over HTTP with the native APIs of SGLang "
            "(/generate), vLLM (/inference/v1/generate, /v1/completions) and llama.cpp (/completion), "
            "token in / token out, so real engine clients can be tried without a GPU: "
            "`actorproxy sim --port 30000`, then "
            "`actorproxy run --backend sglang --backend-url http://127.0.0.1:30000`. "
            "Faults can be injected with POST /sim/faults."
        ),
        formatter_class=_HelpFormatter,
    )
    sim.add_argument("--host", default=d.host, help="address to listen on")
    sim.add_argument("--port", type=int, default=d.port, help="port to listen on (0 picks a free one)")
    sim.add_argument(
        "--token-interval", type=_positive_float, default=e.token_interval, help="seconds between two sampled tokens"
    )
    sim.add_argument(
        "--prefill-latency",
        type=float,
        default=e.prefill_latency,
        help="seconds before the first token of every request",
    )
    sim.add_argument("--seed", type=int, default=e.seed, help="random seed of the simulated policy")
    sim.add_argument(
        "--reply-tokens",
        type=_positive_int,
        default=e.reply_tokens,
        help="every unscripted reply is N tokens of the word ' so' then the end-of-turn token "
        "(long-stream benchmarks count the word); default: the simulated policy's short replies",
    )
    sim.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=e.stream_interval,
        help="tokens per streamed event, as SGLang's --stream-interval: each token still takes "
        "--token-interval, they are streamed in bursts of N",
    )
    sim.add_argument(
        "--decode-steps",
        action="store_true",
        help="decode in engine-wide steps, as a GPU engine batching every running request: a request joins "
        "the next step (a multiple of --token-interval), so all streams get their tokens at the same instants",
    )
    sim.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="SGLang: stream deltas of output_ids/text/logprobs instead of cumulative values",
    )
    sim.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="return simulated MoE routing (SGLang return_routed_experts; vLLM routed_experts)",
    )
    sim.add_argument("--weight-version", default=e.weight_version, help="initial weight version")
    sim.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=e.max_model_len,
        help="context length: longer prompts are refused, outputs are cut to fit",
    )
    sim.add_argument(
        "--record-capacity",
        type=_positive_int,
        default=d.record_capacity,
        help="requests remembered for GET /sim/requests",
    )
    sim.add_argument("--model-path", default=d.model_path, help="model name reported by /model_info and /v1/models")
    sim.add_argument(
        "--tokenizer-path",
        default=None,
        help="a Hugging Face tokenizer directory (default: the built-in qwen3 tokenizer)",
    )
    sim.add_argument(
        "--disable-vllm-generate-endpoint",
        dest="vllm_generate_endpoint",
        action="store_false",
        help="answer 403 on /inference/v1/generate and /inference/v1/abort_requests and leave them out of "
        "/openapi.json, like vLLM 0.32 without --enable-scale-out",
    )
    sim.add_argument(
        "--disable-vllm-dev-mode",
        dest="vllm_dev_mode",
        action="store_false",
        help="serve no /pause, /resume, /is_paused, /abort_requests, /weight_info or /update_weight_version, "
        "like a vLLM without VLLM_SERVER_DEV_MODE=1",
    )
    sim.add_argument("--log-level", default="INFO", help="logging level")


def sim_settings_from_args(args: argparse.Namespace) -> SimServerSettings:
    """The :class:`SimServerSettings` of parsed ``actorproxy sim`` flags: each flag's dest is the name of a
    field of the settings or of their engine's :class:`SimConfig`."""
    flags = {name: value for name, value in vars(args).items() if name not in _SIM_NON_SETTINGS}
    engine = {name: flags.pop(name) for name in attrs.fields_dict(SimConfig) if name in flags}
    # a flag without a field of its name is a TypeError, not dropped
    return SimServerSettings(engine=served_engine(**engine), **flags)


#: ``actorproxy sim`` flags that configure the command, not the simulated server.
_SIM_NON_SETTINGS = frozenset({"command", "log_level"})


async def _until_signal(log: logging.Logger) -> None:
    """Return at the first SIGINT or SIGTERM: the servers' graceful shutdown trigger."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            return


async def _sim_main(settings: SimServerSettings) -> None:
    log = logging.getLogger("actorproxy.sim")

    until_signal = partial(_until_signal, log)

    async with trio.open_nursery() as nursery:
        running: RunningSim = await nursery.start(
            lambda task_status: serve_sim(settings, shutdown_trigger=until_signal, task_status=task_status)
        )
        log.info(
            "simulated engine serving on %s (SGLang /generate, vLLM /inference/v1/generate and /v1/completions, "
            "llama.cpp /completion; tokenizer=%s, weight version=%s)",
            running.url,
            running.engine.tokenizer.name,
            running.engine.weight_version,
        )


def config_from_args(args: argparse.Namespace, argv: Sequence[str] = ()) -> ProxyConfig:
    """The config of parsed ``actorproxy run`` flags (over ``--config`` and the environment)."""
    return _config_and_notes(args, argv)[0]


def _config_and_notes(args: argparse.Namespace, argv: Sequence[str]) -> tuple[ProxyConfig, list[str]]:
    tree = settings_from_namespace(args)
    defaults, notes = apply_compat(tree, args, list(argv))
    config = build_config(tree, config_file=args.config, defaults=defaults)
    check_engine(config, list(argv))
    return config, notes


async def _run(config: ProxyConfig, tokenizer: ChatTokenizer) -> None:
    log = logging.getLogger("actorproxy")
    if config.store.store_kind == "auto":  # durable by default when run as a server (docs/storage.md)
        config = config.evolve(store_kind="sqlite")
    async with trio.open_nursery() as nursery:
        running: RunningProxy = await nursery.start(partial(serve_until_signal, config, tokenizer=tokenizer))
        _warn_if_open(config, running.url)
        for line in banner(config, running):
            log.info("%s", line)


async def _run_workers(config: ProxyConfig) -> None:
    log = logging.getLogger("actorproxy")
    config = config.evolve(store_kind="sqlite")  # the only store several workers can share (preflight)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_workers, config, signals)
            log.info("actorproxy %s serving on %s with %d worker processes (docs/workers.md)", __version__, url,
                     config.server.workers)
            log.info("  store:     sqlite, a file per worker under %s/worker-<i> (durable; crash-recovered)",
                     config.store.data_dir)
            _warn_if_open(config, url)
            log.info("  metrics:   %s/metrics (one worker label each)", url)


def _store_line(config: ProxyConfig) -> str:
    store = config.store
    kind = store.store_kind
    if kind == "ray":
        return f"ray data pool {store.data_pool!r} (namespace {store.ray_namespace})"
    if kind == "memory":
        return "memory (lost at exit; --store sqlite keeps it)"
    # auto is sqlite for "actorproxy run"
    return f"sqlite under {store.data_dir} (durable; crash-recovered; docs/storage.md)"


def _warn_if_open(config: ProxyConfig, url: str) -> None:
    """Say at WARNING that the trainer's routes are open when no admin token is set (docs/security.md)."""
    if not config.security.admin_token:
        logging.getLogger("actorproxy").warning(
            "no --admin-token: every route is open to anyone who reaches %s (setting rewards, finalizing, "
            "draining trajectories, pausing); GET /health says \"access\": \"open\"", url)


def banner(config: ProxyConfig, running: RunningProxy) -> list[str]:
    """What start-up tells the operator: where it listens, engines, tokenizer, access, and what to try."""
    runtime = running.runtime
    engines = config.engines
    if engines.backend == "sim":
        engine = "the built-in simulated engine (real ones: --backend sglang|vllm|llamacpp --backend-url URL)"
    else:
        stats = getattr(runtime.backend, "statistics", None)
        states = {e["name"]: e["healthy"] for e in stats()["engines"]} if stats is not None else {}
        engine = f"{engines.backend}: " + ", ".join(
            f"{url} ({'healthy' if states.get(url, True) else 'DOWN'})" for url in engines.backend_urls
        )
    auth = "admin token required for trainer routes" if config.security.admin_token else (
        f"OPEN: anyone reaching {config.server.host} may set rewards, finalize, drain and pause (--admin-token)")
    if config.security.agent_auth != "none":
        auth += f"; agents need a key ({config.security.agent_auth})"
    curl = (
        f"curl -s {running.url}/v1/chat/completions -H 'X-Session-Id: demo' "
        "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'"
    )
    return [
        f"actorproxy {__version__} serving on {running.url}",
        f"  engine:    {engine}",
        f"  tokenizer: {runtime.tokenizer.name} ({runtime.tokenizer.vocab_size} tokens), "
        f"context window {runtime.context_window}",
        f"  store:     {_store_line(config)}",
        f"  access:    {auth}",
        f"  trajectory files: {config.server.trajectory_dir}" if config.server.trajectory_dir else "  trajectory "
        "files: off (--trajectory-dir DIR)",
        f"  metrics:   {running.url}/metrics",
        f"  try:       {curl}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    freed_memory.limit_heaps()  # before any thread (the tokenizer's too) makes a heap of its own
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "sim":
        configure_logging(args.log_level)
        trio.run(_sim_main, sim_settings_from_args(args))
        return 0
    try:
        config, notes = _config_and_notes(args, argv)
    except ValueError as exc:
        print(f"actorproxy: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.server.log_level, config.server.log_format)
    for note in notes:
        logging.getLogger("actorproxy").info("compatibility: %s", note)
    if args.command == "check":
        return 0 if trio.run(run_checks, config) else 2
    try:
        preflight(config)
        ray_preflight(config)
        tokenizer = load_tokenizer_checked(config.engines.tokenizer_path)
        if config.server.workers > 1:
            trio.run(_run_workers, config)
        else:
            trio.run(_run, config, tokenizer)
    except BaseException as exc:  # a start-up failure arrives wrapped in exception groups
        stopped = shutdown_failure(exc)
        if stopped is not None:  # served, but could not stop cleanly (the store's disk)
            print(f"actorproxy: {stopped}", file=sys.stderr)
            return 1
        failure = exc if isinstance(exc, StartupError) else startup_failure(exc, config)
        if failure is None:
            raise
        print(f"actorproxy: {failure}", file=sys.stderr)
        return 2
    if config.store.store_kind == "ray":
        exit_after_ray(0)  # Ray's core worker may abort the interpreter's teardown: end here, flushed
    return 0


def ray_preflight(config: ProxyConfig) -> None:
    """The Ray actors the command line names: the data pool must be ours, the reward worker must exist."""
    store = config.store
    if store.store_kind == "ray":
        check_pool(store.ray_address, store.ray_namespace, store.data_pool)
    if config.gateway.reward_worker_name:
        RayRewardWorker(config.gateway.reward_worker_name, address=store.ray_address, namespace=store.ray_namespace,
                        pad_id=0, prompt_length=1, response_length=1, timeout=config.gateway.reward_timeout).connect()


def preflight(config: ProxyConfig) -> None:
    """The checks that need no engine: exposure and the port."""
    problem = exposure_problem(
        config.server.host, admin_token=config.security.admin_token, insecure=config.security.insecure
    )
    if problem is not None:
        raise StartupError("--host", problem)
    check_port(config.server.host, config.server.port)
    if config.server.workers > 1 and config.store.store_kind in ("memory", "ray"):
        raise StartupError("--workers", f"--store {config.store.store_kind} cannot be shared by several workers: "
                           "use --store sqlite (each worker keeps its own file, the trainer reads them all) or "
                           "--workers 1 (docs/workers.md)")
    if config.server.workers > 1 and config.server.api_dialect == "dressage":
        raise StartupError("--api-dialect", "the Dressage dialect's batch read hands out prompt groups whole, and a "
                           "group's sessions are served by several workers, each seeing only its own: it would "
                           "split groups (a GRPO group's advantages need all of it); use --workers 1 (docs/workers.md)")
    if config.server.workers > 1 and config.engines.engine_abort_all:
        raise StartupError("--engine-abort-all", "one worker's abort_all would stop the other workers' generations "
                           "before their pause reaches them, and those turns would end as if the engine had finished: "
                           "use --workers 1, or one abort per generation (the default)")


async def run_checks(config: ProxyConfig) -> bool:
    """``actorproxy check``: one line per check; True when all pass."""
    ok = True

    def report(name: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok = ok and passed
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {detail}", flush=True)

    report("settings", True, f"{config.engines.backend} engine, listening on {config.server.host}:{config.server.port}")
    try:
        preflight(config)
        report("listen", True, f"{config.server.host}:{config.server.port} is free and allowed")
    except StartupError as exc:
        report("listen", False, str(exc))
    try:
        tokenizer = await trio.to_thread.run_sync(load_tokenizer_checked, config.engines.tokenizer_path)
    except StartupError as exc:
        report("tokenizer", False, str(exc))
        return False
    report("tokenizer", True, f"{tokenizer.name}, {tokenizer.vocab_size} tokens, chat template present")
    try:
        info = await probe_engines(config, tokenizer)
        report("engines", True, f"model {info.model_id!r}, max model length {info.max_model_len}")
    except StartupError as exc:
        report("engines", False, str(exc))
    return ok
