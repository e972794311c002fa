"""What the dashboards and alert rules ask Prometheus, as data the tests can check.

    for source, expr in dashboard_exprs(): ...       # ("overview.json: Requests / s [A]", "sum(rate(...))")
    names, labels = references(substitute(expr))     # metric names and the label names they use

PromQL is read with a small tokenizer, not a full parser: enough to find every metric a query
selects and every label it names; Prometheus itself (tests/observability/test_live.py) checks
that each query parses. `fast_rules` and NEEDS_PIPELINE are shared by test_live.py and
test_pipeline_live.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.support.procs import ROOT

DASHBOARD_DIR = ROOT / "dashboards" / "grafana"
ALERTS_DIR = ROOT / "alerts"
RULE_FILES = sorted(ALERTS_DIR.glob("*.rules.yaml"))
RUNBOOK = ROOT / "docs" / "runbook.md"

NEEDS_PIPELINE = "switchboard_shard_pipeline_"
"""The pipeline panels need a shard split over stages (--pipeline-parallel-size), which the synthetic
engine the test Cluster runs cannot be. A real 2-stage torch shard's panels and its stage-gone alert are
proven against Prometheus in tests/observability/test_pipeline_live.py; test_live.py asserts the synthetic
shards really export none, so this exemption lapses loudly if that changes."""

# Grafana's built-in interval variables -> a value Prometheus accepts; any other variable is a
# label-value filter (`=~"$tier"`), which ".*" opens fully.
INTERVAL_VARS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "inf", "nan", "start", "end"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"(?:[^\"\\]|\\.)*\"")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?")


def substitute(expr: str) -> str:
    """Grafana template variables -> values Prometheus accepts."""
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return INTERVAL_VARS.get(name, ".*")
    return _VAR.sub(repl, expr)


def references(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(metric name -> label names in its matchers, label names used in by/on/without/... clauses)."""
    names: dict[str, set[str]] = {}
    for m in _SELECTOR.finditer(expr):
        if m.group(1) and m.group(1) not in _KEYWORDS:
            names.setdefault(m.group(1), set()).update(_MATCHER.findall(m.group(2)))
    grouping = {label.strip() for _, labels in _GROUPING.findall(expr) for label in labels.split(",")
                if label.strip()}
    rest = _GROUPING.sub(" ", _SELECTOR.sub(lambda m: " " + (m.group(1) or "") + " ", expr))
    rest = _RANGE.sub(" ", _STRING.sub(" ", rest))
    for m in _IDENT.finditer(rest):
        if m.group(2) is None and m.group(1) not in _KEYWORDS:  # followed by "(": a function
            names.setdefault(m.group(1), set())
    return names, grouping


def label_values_queries(board: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(variable, metric selector, label) of each `label_values(selector, label)` variable."""
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", query)
        assert m, f"{var['name']}: only label_values(selector, label) queries are used, got {query!r}"
        yield var["name"], m.group(1), m.group(2)


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


def dashboard_exprs(only: set[str] | None = None) -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target of every dashboard (or of the files in `only`)."""
    for fname, board in dashboards().items():
        if only is not None and fname not in only:
            continue
        for panel in panels(board):
            for target in panel.get("targets", []):
                yield f"{fname}: {panel['title']} [{target['refId']}]", target["expr"]


def rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def rule_exprs() -> Iterator[tuple[str, str, Path]]:
    """(where, expr, file) for every recording and alerting rule."""
    for path in RULE_FILES:
        for rule in rules(path):
            yield f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"], path


def recorded_names() -> set[str]:
    return {rule["record"] for path in RULE_FILES for rule in rules(path) if "record" in rule}


def fast_rules(workdir: Path) -> list[Path]:
    """Copies of the rule files that evaluate every second and fire without waiting (`for: 0s`)."""
    out = []
    for path in RULE_FILES:
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = "0s"
        copy = workdir / path.name
        copy.write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(copy)
    return out
