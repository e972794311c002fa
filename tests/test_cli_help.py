"""Every flag of every process has help text, all from one mechanism (data_plane/common/settings_cli.py):
gateway, shard, cache node, control plane and `switchboard up` build their parsers from their settings
classes; deprecated spellings still parse into the same field."""

from __future__ import annotations

import argparse
import os

import pytest

from tests.support.procs import switchboard


def _settings_classes() -> dict[str, type]:
    from control_plane.launcher import UpSettings
    from control_plane.scaling.cli import SimulateSettings
    from control_plane.settings import ControlPlaneSettings
    from data_plane.cache.node import CacheNodeSettings
    from data_plane.gateway.settings import GatewaySettings
    from data_plane.shard.app import ShardSettings

    return {"gateway": GatewaySettings, "shard": ShardSettings, "cache-node": CacheNodeSettings,
            "control-plane": ControlPlaneSettings, "up": UpSettings, "autoscale simulate": SimulateSettings}


@pytest.mark.parametrize("command", ["gateway", "shard", "cache-node", "control-plane", "up", "autoscale simulate"])
def test_every_flag_has_help_text(command: str) -> None:
    from data_plane.common.settings_cli import build_parser

    parser = build_parser(_settings_classes()[command], f"switchboard {command}")
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert flags
    missing = [a.option_strings[0] for a in flags
               if not a.help or not a.help.split("[env")[0].strip()]
    assert not missing, f"switchboard {command}: flags without help text: {missing}"


def test_the_console_flags_have_help_text() -> None:
    from admin_ui.settings import build_parser

    actions = [a for a in build_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert actions and all(a.help for a in actions)


@pytest.mark.parametrize("command", ["control-plane", "cache-node", "gateway", "shard"])
def test_help_runs(command: str) -> None:
    shown = switchboard(command, "--help")
    assert shown.returncode == 0, shown.stderr
    assert "[env SWITCHBOARD_" in shown.stdout


@pytest.mark.parametrize("command", ["cache-node", "gateway", "shard"])
def test_help_says_where_the_tokens_come_from(command: str) -> None:
    """These take the cluster and metrics tokens from the environment only (no flag), and their /metrics is
    closed without one: an operator starting one by hand learned neither from --help."""
    shown = " ".join(switchboard(command, "--help").stdout.split())
    assert "SWITCHBOARD_CLUSTER_TOKEN" in shown and "SWITCHBOARD_METRICS_TOKEN" in shown, shown[:600]
    assert "/metrics answers 401" in shown


@pytest.mark.parametrize(("command", "flags"), [
    *[(c, ("--tls-cert", "--tls-key", "--ca-bundle")) for c in ("gateway", "shard", "cache-node", "control-plane",
                                                               "up", "console")],
    ("admin status", ("--ca-bundle",)),
])
def test_help_lists_the_tls_flags(command: str, flags: tuple[str, ...]) -> None:
    """`--tls-cert/--tls-key/--ca-bundle` worked on every subcommand (control_plane/cli.py takes them off argv)
    but no `--help` named them: an operator found TLS only in the README."""
    from data_plane.common.tls import TLS_FLAGS

    shown = " ".join(switchboard(*command.split(), "--help").stdout.split())
    for flag in flags:
        assert f"{flag} FILE" in shown and f"[env {TLS_FLAGS[flag]}]" in shown, (flag, shown[-900:])


def test_a_tls_flag_given_to_a_subcommands_own_parser_sets_its_variable(tmp_path, monkeypatch) -> None:
    """The flags in a subcommand's parser (its --help) work there too, as `switchboard` would take them:
    into the environment, never into the settings."""
    from data_plane.cache.node import CacheNodeSettings
    from data_plane.common.settings_cli import parse_settings

    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    settings = parse_settings(CacheNodeSettings, ["--ca-bundle", str(ca), "--port", "8299"], prog="switchboard cache-node")
    assert settings.port == 8299 and os.environ["SSL_CERT_FILE"] == str(ca.resolve())
    with pytest.raises(SystemExit):
        parse_settings(CacheNodeSettings, ["--tls-cert", str(tmp_path / "missing.pem")], prog="switchboard cache-node")


def test_the_command_list_names_what_each_command_has() -> None:
    shown = switchboard("--help").stdout
    admin = next(line for line in shown.splitlines() if line.strip().startswith("admin "))
    assert "processes" in admin, admin  # `switchboard admin processes` was missing from the list
    bench = next(line for line in shown.splitlines() if line.strip().startswith("bench "))
    assert "multiturn" in bench, bench


def test_deprecated_spellings_parse_into_the_same_field(capsys: pytest.CaptureFixture[str]) -> None:
    from control_plane.app import parse_settings as control_plane
    from data_plane.cache.node import parse_settings as cache_node

    assert cache_node(["--registry", "http://127.0.0.1:8300"]).registry_url == "http://127.0.0.1:8300"
    assert cache_node(["--registry-url", "http://127.0.0.1:8300"]).registry_url == "http://127.0.0.1:8300"
    assert control_plane(["--warmup", "0", "--reap-interval", "0.5"]).warmup_s == 0
    assert control_plane(["--warmup-s", "1.5"]).warmup_s == 1.5
    assert "--warmup is deprecated; use --warmup-s" in capsys.readouterr().err


def test_typed_fields_validate_once_at_parse_time(capsys: pytest.CaptureFixture[str]) -> None:
    from data_plane.common.settings_cli import parse_settings
    from data_plane.gateway.settings import GatewaySettings

    s = parse_settings(GatewaySettings, ["--shard-urls", "http://127.0.0.1:8101,http://127.0.0.1:8102/",
                                         "--tier-rpm", "free=600", "--routing-policy", "kv_aware"], prog="gw")
    assert [str(u) for u in s.shard_urls] == ["http://127.0.0.1:8101/", "http://127.0.0.1:8102/"]
    assert s.tier_rpm == {"free": 600} and s.routing_policy == "kv_aware"
    with pytest.raises(SystemExit):
        parse_settings(GatewaySettings, ["--tier-rpm", "free=0"], prog="gw")
    assert "gw: --tier-rpm" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "flag"), [
    ("gateway", "--keys-file"), ("gateway", "--session-keys-file"),
    ("shard", "--kv-keys-file"),  # read only by the torch engine's KV sealer: was silently ignored with synthetic
    ("control-plane", "--abuse-rules"), ("control-plane", "--state-keys-file"),  # the latter: only with a state dir
    ("up", "--abuse-rules"),
])
def test_a_missing_input_file_is_one_line_naming_its_flag(tmp_path, command: str, flag: str) -> None:
    missing = tmp_path / "nope.yaml"
    extra = ["--engine", "synthetic"] if command == "shard" else []
    ran = switchboard(command, flag, str(missing), "--port" if command != "up" else "--state-dir",
                      "1" if command != "up" else str(tmp_path / "state"), *extra, timeout=60)
    assert ran.returncode == 2, (ran.returncode, ran.stderr[-2000:])
    assert "Traceback" not in ran.stderr
    assert ran.stderr.strip() == f"switchboard {command}: {flag}: no such file {str(missing)!r}"
    a_dir = switchboard(command, flag, str(tmp_path), "--port" if command != "up" else "--state-dir",
                        "1" if command != "up" else str(tmp_path / "state"), *extra, timeout=60)
    assert a_dir.returncode == 2 and a_dir.stderr.strip().endswith(f"{flag}: {str(tmp_path)!r} is not a file")


@pytest.mark.parametrize(("command", "flag", "content", "said"), [
    ("gateway", "--keys-file", "keys: [ {key: ", "is not valid YAML (line 1, column 15: expected the node content"),
    ("gateway", "--keys-file", "keys: [{key: sk-a, tenant: t, tier: gold}]", "key id a4a6d307ad00 has tier 'gold'"),  # an unknown tier
    ("gateway", "--tiers-file", "tiers: {free: {priority: x}}", "invalid tier policy: tiers.free.priority"),
    ("control-plane", "--tiers-file", "tiers: [", "is not valid YAML"),
    ("control-plane", "--abuse-rules", "nonsense: 1", "unknown abuse settings ['nonsense']"),
])
def test_a_config_file_that_does_not_parse_or_fit_is_one_line(tmp_path, command: str, flag: str, content: str,
                                                               said: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    keys = [] if flag == "--keys-file" else ["--keys-file", str(_keys_file(tmp_path))]
    ran = switchboard(command, flag, str(bad), *(keys if command == "gateway" else []), "--port", "1", timeout=60)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr[-2000:]
    line = ran.stderr.strip().splitlines()[-1]
    assert line.startswith(f"switchboard {command}: ") and said in line, line


def _keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys: [{key: sk-a, tenant: t, tier: free}]\n")
    return path


def test_a_policy_flag_still_takes_inline_yaml(tmp_path) -> None:
    """--tiers-file / --safety-file take a file or YAML text (data_plane/common/yaml_source.py): the file
    check leaves the text to the policy's own validation."""
    ran = switchboard("gateway", "--tiers-file", "tiers: {free: {priority: x}}", "--keys-file",
                      str(_keys_file(tmp_path)), "--port", "1", timeout=60)
    assert ran.returncode == 1 and "invalid tier policy: tiers.free.priority" in ran.stderr, ran.stderr[-2000:]


@pytest.mark.parametrize("command", ["shard", "up"])
def test_the_model_help_names_the_default_model_served(command: str) -> None:
    """The shard's --model help said SmolLM2-135M while it served (and `up` named) SmolLM2-135M-Instruct."""
    from data_plane.model_store import default_gguf

    served = default_gguf().name.split(".")[0]  # SmolLM2-135M-Instruct.Q4_1.gguf
    description = _settings_classes()[command].model_fields["model"].description
    assert f"(default {served})" in description
