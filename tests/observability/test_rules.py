"""The alert rules: promtool accepts them and their unit tests; every alert is documented and tested.

promtool comes with Debian's `prometheus` package (`make sysdeps`); without it those tests skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability.exprs import ALERTS_DIR, RULE_FILES, RUNBOOK, rules

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
TEST_FILES = sorted((ALERTS_DIR / "tests").glob("*.yaml"))
ALERTS = {rule["alert"]: rule for path in RULE_FILES for rule in rules(path) if "alert" in rule}


def promtool(*args: str, cwd: Path = ALERTS_DIR) -> None:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


@needs_promtool
def test_promtool_check_rules() -> None:
    promtool("check", "rules", *(p.name for p in RULE_FILES))


@needs_promtool
def test_promtool_unit_tests() -> None:
    promtool("test", "rules", *(str(p.relative_to(ALERTS_DIR)) for p in TEST_FILES))


@needs_promtool
def test_example_prometheus_config(tmp_path: Path) -> None:
    """promtool checks that the credentials file exists: an operator's copy, beside its token file."""
    for path in (ALERTS_DIR / "prometheus.example.yml", *RULE_FILES):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "switchboard-metrics-token").write_text("sb-metrics-example\n")
    promtool("check", "config", "prometheus.example.yml", cwd=tmp_path)


def test_example_prometheus_config_presents_the_metrics_token() -> None:
    """Every Switchboard /metrics is guarded: a job without credentials scrapes 401s (`up` 0)."""
    config = yaml.safe_load((ALERTS_DIR / "prometheus.example.yml").read_text())
    for job in config["scrape_configs"]:
        assert job["authorization"] == {"type": "Bearer", "credentials_file": "switchboard-metrics-token"}, job


def test_example_prometheus_config_loads_every_rule_file() -> None:
    config = yaml.safe_load((ALERTS_DIR / "prometheus.example.yml").read_text())
    assert sorted(config["rule_files"]) == sorted(p.name for p in RULE_FILES)


def test_alertmanager_example() -> None:
    config = yaml.safe_load((ALERTS_DIR / "alertmanager.example.yml").read_text())
    receivers = {r["name"] for r in config["receivers"]}
    routes = [config["route"], *config["route"].get("routes", [])]
    assert {r["receiver"] for r in routes} <= receivers
    severities = {rule["labels"]["severity"] for rule in ALERTS.values()}
    routed = " ".join(m for r in routes for m in r.get("matchers", []))
    assert all(s in routed for s in severities), f"every severity {severities} has a route"
    amtool = shutil.which("amtool")
    if amtool:  # Debian's prometheus-alertmanager; optional here
        done = subprocess.run([amtool, "check-config", "alertmanager.example.yml"], cwd=ALERTS_DIR,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_is_documented(name: str) -> None:
    rule = ALERTS[name]
    assert rule["labels"]["severity"] in {"page", "ticket", "warning"}
    annotations = rule["annotations"]
    assert annotations["summary"] and annotations["description"]
    path, _, anchor = annotations["runbook_url"].partition("#")
    assert path == "docs/runbook.md" and anchor
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), re.MULTILINE)}
    assert anchor in headings, f"docs/runbook.md has no section for #{anchor}"


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_has_firing_and_silent_unit_tests(name: str) -> None:
    cases = [case for path in TEST_FILES for group in yaml.safe_load(path.read_text())["tests"]
             for case in group.get("alert_rule_test", []) if case["alertname"] == name]
    assert any(case["exp_alerts"] for case in cases), f"no promtool test where {name} fires"
    assert any(not case["exp_alerts"] for case in cases), f"no promtool test where {name} stays silent"


def test_every_builtin_alert_has_a_runbook_section() -> None:
    """Without Prometheus the control plane fires its own checks, and `switchboard admin status` and the
    console's Alerts page name them ("alerts 3 firing: SwitchboardNoHealthyShard, SwitchboardMembersCritical,
    SwitchboardSignalsIncomplete"): two of the four had no section in docs/runbook.md to look up."""
    from types import SimpleNamespace

    from control_plane.admin.alerting import builtin_alerts
    from control_plane.policy_store import DegradationRecord
    from data_plane.common.ladder import Level

    fired = builtin_alerts([{"id": "shard-0", "service": "shard", "status": "critical"}], warming_up=False,
                           degradation=DegradationRecord(level=Level.ENTERPRISE_ONLY, reason="test"),
                           signals=SimpleNamespace(complete=False, missing=("shard-0",)))
    names = {alert["name"] for alert in fired}
    assert len(names) == 4, names  # every check fired: a new one joins this test by itself
    headings = {h.strip().lower() for h in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), re.MULTILINE)}
    assert not {n for n in names if n.lower() not in headings}, "built-in alerts without a runbook section"
