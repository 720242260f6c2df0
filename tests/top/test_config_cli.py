"""The settings tree: flags generated from it, a TOML config file, the environment, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from actorproxy.cli import build_parser, config_from_args, main
from actorproxy.config import FIELD_SECTIONS, SECTIONS, ProxyConfig

RUN = build_parser()


@pytest.fixture(autouse=True)
def _tree_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest.py sets ACTORPROXY_STORE=memory for the proxies other tests start; these compare with the tree."""
    monkeypatch.delenv("ACTORPROXY_STORE", raising=False)


def _config(*argv: str) -> ProxyConfig:
    return config_from_args(RUN.parse_args(["run", *argv]))


def test_defaults_are_the_trees() -> None:
    assert _config() == ProxyConfig.of()
    assert ProxyConfig.of().server.port == 8800 and ProxyConfig.of().engines.backend == "sim"


def test_every_field_has_a_flag_and_help() -> None:
    help_text = RUN._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    for name in FIELD_SECTIONS:
        flag = "--" + name.replace("_", "-")
        if name == "backend_urls":
            flag = "--backend-url"
        elif name in ("tool_call_format", "reasoning_format"):
            flag = "--model-tool-call-type" if name == "tool_call_format" else "--model-reasoning-type"
        elif name == "parse_backend":
            flag = "--tool-call-parse-backend"
        assert flag in help_text, name
    for kind in SECTIONS.values():
        assert kind.__doc__ in help_text


def test_flags_set_fields_in_their_sections() -> None:
    config = _config(
        "--port", "0", "--backend", "vllm", "--backend-url", "http://a:1,http://b:2", "--backend-url", "http://c:3",
        "--partial-rollout", "--no-dynamic-max-tokens", "--max-sessions", "7", "--model-tool-call-type", "qwen3_coder",
    )
    assert config.server.port == 0
    assert config.engines.backend_urls == ("http://a:1", "http://b:2", "http://c:3")
    assert config.preemption.partial_rollout is True
    assert config.limits.dynamic_max_tokens is False and config.limits.max_sessions == 7
    assert config.parsing.tool_call_format == "qwen3_coder"


def test_a_toml_file_under_flags(tmp_path: Path) -> None:
    path = tmp_path / "proxy.toml"
    path.write_text(
        '[server]\nport = 9100\n[engines]\nbackend = "sglang"\nbackend_urls = ["http://gpu:30000"]\n'
        '[trajectory]\non_history_rewrite = "recompute"\nverify_tito = true\n'
    )
    config = _config("--config", str(path), "--port", "9200")
    assert config.server.port == 9200  # the flag wins
    assert config.engines.backend == "sglang" and config.engines.backend_urls == ("http://gpu:30000",)
    assert config.trajectory.on_history_rewrite == "recompute" and config.trajectory.verify_tito is True


def test_the_environment_under_file_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTORPROXY_ADMIN_TOKEN", "from-env")
    assert _config().security.admin_token == "from-env"
    path = tmp_path / "proxy.toml"
    path.write_text('[security]\nadmin_token = "from-file"\n')
    assert _config("--config", str(path)).security.admin_token == "from-file"
    assert _config("--config", str(path), "--admin-token", "from-flag").security.admin_token == "from-flag"
    assert "from-" not in repr(_config())  # secrets stay out of reprs and /health
    assert "admin_token" not in _config().public()["security"]


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[limits]\nmax_sesions = 3\n", "max_sesions"),
        ("[nosuch]\nx = 1\n", "unknown section [nosuch]"),
        ("[limits]\nmax_sessions = 0\n", "--max-sessions must be positive"),
        ("[limits]\nmax_sessions = 1.5\n", "--max-sessions: expected an integer"),
        ('[trajectory]\nverify_tito = "false"\n', "--verify-tito: expected true or false"),
        ('[trajectory]\nsub_agents = "maybe"\n', "sub-agents"),
        ('[server]\nprocessing_heartbeats = "sometimes"\n',
         "--processing-heartbeats: expected one of 'auto', 'always', 'never', got 'sometimes'"),
        ("[engines]\nbackend = \"vllm\"\n", "--backend vllm needs at least one engine URL"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, expected: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("actorproxy: ") and "\n" not in err
    assert expected in err


def test_engine_shorthands() -> None:
    config = _config("--vllm-addresses", "http://a:1,http://b:2")
    assert config.engines.backend == "vllm" and config.engines.backend_urls == ("http://a:1", "http://b:2")
    config = _config("--sglang-router-url", "http://router:30000")
    assert config.engines.backend == "sglang" and config.engines.backend_urls == ("http://router:30000",)


def test_of_and_evolve_take_settings_by_name() -> None:
    config = ProxyConfig.of(port=0, partial_rollout=True)
    assert config.server.port == 0 and config.preemption.partial_rollout
    assert config.evolve(max_sessions=3).limits.max_sessions == 3
    with pytest.raises(TypeError, match="no setting 'nope'"):
        ProxyConfig.of(nope=1)


def test_the_simulated_engines_tool_call_chances() -> None:
    """--sim-tool-call-probability, --sim-followup-tool-call-probability and --sim-decode-steps reach the
    built-in engine."""
    from actorproxy.runtime.backends import make_backend
    from actorproxy.sim import SimEngine
    from actorproxy.tokenization.tokenizer import load_tokenizer

    config = _config("--sim-tool-call-probability", "1", "--sim-followup-tool-call-probability", "0.25",
                     "--sim-decode-steps")
    engine = make_backend(config, load_tokenizer(None))
    assert isinstance(engine, SimEngine)
    assert engine.config.tool_call_probability == 1.0 and engine.config.followup_tool_call_probability == 0.25
    assert engine.config.decode_steps
    default = make_backend(_config(), load_tokenizer(None))
    assert isinstance(default, SimEngine)
    assert default.config.tool_call_probability == 0.7 and default.config.followup_tool_call_probability is None
    assert not default.config.decode_steps
    assert main(["run", "--sim-tool-call-probability", "1.5"]) == 2
    task = '{"name": "task", "arguments": {"subagent_type": "general"}}'
    scripted = make_backend(_config("--sim-tool-calls", task), load_tokenizer(None))
    assert isinstance(scripted, SimEngine) and scripted.config.tool_calls == (("task", '{"subagent_type": "general"}'),)
    assert default.config.tool_calls == ()
    both = make_backend(_config("--sim-tool-calls", f"[{task}, {task}]"), load_tokenizer(None))
    assert isinstance(both, SimEngine) and len(both.config.tool_calls) == 2
    for bad in ("task", "[]", '{"name": "task"}', '{"name": "", "arguments": {}}', '{"name": "t", "arguments": 3}',
                f"[{task}, 3]"):
        assert main(["run", "--sim-tool-calls", bad]) == 2
