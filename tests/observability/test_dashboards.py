"""Dashboards and rules use only metrics (and labels) the code exports, per the catalogue."""

from __future__ import annotations

import re

import pytest

from dashboards.catalogue import TARGET_LABELS, series_names
from dashboards.push import DASHBOARD_DIR, load_dashboards
from tests.observability.exprs import (
    dashboard_exprs,
    dashboards,
    label_values_queries,
    panels,
    recorded_names,
    references,
    rule_exprs,
    substitute,
)

SERIES = series_names()
BOARDS = dashboards()


def allowed_labels(name: str) -> set[str] | None:
    """Labels a selector of `name` may use (None: any, for recorded series)."""
    metric = SERIES.get(name)
    if name not in SERIES:
        return None
    labels = set(TARGET_LABELS) | {"__name__"}
    if metric is not None:
        labels |= set(metric.labels)
    if name.endswith("_bucket"):
        labels.add("le")
    return labels


def check_expr(where: str, expr: str, known: set[str]) -> list[str]:
    problems = []
    names, grouping = references(substitute(expr))
    if not names:
        problems.append(f"{where}: selects no metric: {expr!r}")
    usable: set[str] = {"le"} | set(TARGET_LABELS)
    for name, labels in names.items():
        if name not in known:
            problems.append(f"{where}: {name!r} is not a metric the code exports (see docs/metrics.md)")
            continue
        allowed = allowed_labels(name)
        if allowed is None:
            usable |= {"tier", "service"}  # recording rules in alerts/ keep these
            continue
        usable |= allowed
        for label in labels - allowed:
            problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(allowed)})")
    for label in grouping - usable:
        problems.append(f"{where}: groups by {label!r}, which none of {sorted(names)} carries")
    return problems


def test_dashboard_files() -> None:
    assert set(BOARDS) == {"overview.json", "data-plane.json", "gateway.json", "cache.json", "control-plane.json"}
    assert len(load_dashboards(DASHBOARD_DIR)) == len(BOARDS)


@pytest.mark.parametrize("fname", sorted(BOARDS))
def test_dashboard_structure(fname: str) -> None:
    board = BOARDS[fname]
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"].startswith("Switchboard / ")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [p["title"] for p in panels(board) if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "panel titles must be unique within a dashboard"
    queries = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    queries += [selector for _, selector, _ in label_values_queries(board)]
    for used in set(re.findall(r"\$\{?(\w+)", " ".join(queries))) - {"__rate_interval", "__interval"}:
        assert used in variables, f"{fname} uses ${used} but defines no such variable"
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
    for name, var in variables.items():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}", name


def test_dashboard_exprs_use_only_exported_metrics() -> None:
    known = set(SERIES)
    problems = [p for where, expr in dashboard_exprs() for p in check_expr(where, expr, known)]
    for fname, board in BOARDS.items():
        for var, selector, label in label_values_queries(board):
            problems += check_expr(f"{fname}: ${var}", selector, known)
            names, _ = references(selector)
            for name in names:
                allowed = allowed_labels(name)
                if allowed is not None and label not in allowed:
                    problems.append(f"{fname}: ${var} lists {label!r}, which {name} does not carry")
    assert not problems, "\n".join(problems)


def test_rule_exprs_use_only_exported_metrics() -> None:
    recorded = recorded_names()
    problems = []
    known = set(SERIES) | recorded
    for where, expr, _ in rule_exprs():
        problems += check_expr(where, expr, known)
    assert not problems, "\n".join(problems)


def test_the_checker_catches_what_it_should() -> None:
    known = set(SERIES)
    assert check_expr("t", 'sum by (tier) (rate(switchboard_gateway_requests_total{tier=~"$tier"}[$__rate_interval]))',
                      known) == []
    assert check_expr("t", "vllm:prompt_tokens_total offset 5m or vector(0)", known) == []
    assert "not a metric" in " ".join(check_expr("t", "rate(vllm:prompt_tokens[5m])", known))  # no _total
    assert "no label 'tier'" in " ".join(check_expr("t", 'vllm:num_requests_running{tier="free"}', known))
    assert "groups by 'shard'" in " ".join(check_expr("t", "sum by (shard) (switchboard_cache_bytes)", known))
    assert "not a metric" in " ".join(check_expr("t", 'histogram_quantile(0.9, rate(switchboard_x_bucket[1m]))', known))


TIME_UNITS = {"s", "ms", "µs", "ns", "dtdurations", "dtdurationms"}
BYTE_RATE_UNITS = {"Bps", "binBps", "decBps"}
RATIO_UNITS = {"percentunit", "percent"}


def target_unit(panel: dict, target: dict) -> str:
    """The unit Grafana shows `target` in: the panel's, or an override's that matches the target."""
    unit: str = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    legend = re.sub(r"\{\{\s*\w+\s*\}\}", "x", target.get("legendFormat", ""))
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        kind, option = override["matcher"]["id"], override["matcher"].get("options", "")
        if (kind == "byFrameRefID" and option == target["refId"]) or (kind == "byName" and option == legend) \
                or (kind == "byRegexp" and re.fullmatch(option, legend)):
            unit = next((p["value"] for p in override["properties"] if p["id"] == "unit"), unit)
    return unit


def unit_problems(where: str, panel: dict, target: dict) -> list[str]:
    unit, expr, legend = target_unit(panel, target), target["expr"], target.get("legendFormat", "")
    problems = []
    if unit in TIME_UNITS and "_seconds" not in expr:
        problems.append(f"{where}: shown in {unit!r} but selects no _seconds series ({legend!r})")
    if re.search(r"\b(rate|increase|irate)\([^()]*bytes[^()]*\)", expr) and " / " not in expr \
            and unit not in BYTE_RATE_UNITS:
        problems.append(f"{where}: a byte rate shown in {unit!r}, not bytes/s ({legend!r})")
    if re.search(r"\b(hit rate|ratio|share)\b", legend) and unit not in RATIO_UNITS:
        problems.append(f"{where}: a ratio shown in {unit!r}, not percent ({legend!r})")
    return problems


def test_every_target_is_shown_in_its_own_unit() -> None:
    """A panel with two kinds of series gives the second its unit (an override): the ledger's failures / s
    read as milliseconds beside the write p95, the cache nodes' KV bytes / s as a bare count beside
    evictions / s, the response cache's hit rate as 0.75 beside lookups / s."""
    problems = [p for fname, board in BOARDS.items() for panel in panels(board)
                for target in panel.get("targets", [])
                for p in unit_problems(f"{fname}: {panel['title']} [{target['refId']}]", panel, target)]
    assert not problems, "\n".join(problems)


def test_the_unit_check_catches_what_it_should() -> None:
    def panel(unit: str, expr: str, legend: str, overrides: list | None = None) -> list[str]:
        p = {"fieldConfig": {"defaults": {"unit": unit}, "overrides": overrides or []}}
        return unit_problems("t", p, {"refId": "B", "expr": expr, "legendFormat": legend})
    failures = "sum(rate(switchboard_ledger_write_failures_total[5m]))"
    assert panel("s", failures, "failures / s")
    assert not panel("s", failures, "failures / s", [{"matcher": {"id": "byFrameRefID", "options": "B"},
                                                      "properties": [{"id": "unit", "value": "ops"}]}])
    assert not panel("s", "histogram_quantile(0.95, sum by (le) (rate(x_seconds_bucket[5m])))", "p95")
    assert panel("short", "sum by (d) (rate(switchboard_cache_kv_transfer_bytes_total[5m]))", "bytes {{d}}")
    assert not panel("short", "sum(rate(a_total[5m])) / sum(rate(b_total[5m]))", "hit rate",
                     [{"matcher": {"id": "byRegexp", "options": "hit.*"}, "properties": [{"id": "unit",
                                                                                         "value": "percentunit"}]}])
    assert panel("short", "sum(rate(a_total[5m])) / sum(rate(b_total[5m]))", "hit rate")
