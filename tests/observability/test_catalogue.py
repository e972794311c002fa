"""docs/metrics.md is generated from the code; the catalogue reads every process's metrics."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from dashboards.catalogue import JOBS, PROCESSES, catalogue, render_markdown, series_names
from tests.observability.exprs import ROOT


def test_docs_metrics_md_is_generated_from_the_code() -> None:
    doc = ROOT / "docs" / "metrics.md"
    assert doc.read_text() == render_markdown(), (
        "docs/metrics.md is out of date with the metrics in the code; regenerate it with\n"
        "    .venv/bin/python -m dashboards.catalogue > docs/metrics.md")


def test_every_process_has_metrics_and_a_job() -> None:
    by_process = {m.process for m in catalogue()}
    assert by_process == set(PROCESSES) == set(JOBS)


def test_exposition_names_follow_prometheus_client() -> None:
    names = series_names()
    assert "vllm:prompt_tokens_total" in names and "vllm:prompt_tokens" not in names
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
            "vllm:time_to_first_token_seconds_count"} <= set(names)
    assert "switchboard_cache_requests_total" in names  # declared with _total: not doubled
    ttft = names["switchboard_gateway_ttft_seconds_bucket"]
    assert ttft is not None and ttft.labels == ("tier",) and ttft.process == "gateway"


def test_metric_names_are_unique_across_processes() -> None:
    seen: dict[str, str] = {}
    for m in catalogue():
        assert m.name not in seen, f"{m.name} exported by both {seen[m.name]} and {m.process}"
        seen[m.name] = m.process


METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}

NOT_IN_A_PROCESS_YET: dict[str, str] = {}
"""Metrics classes no process instantiates yet; once one does, it belongs in catalogue.PROCESSES."""


def metric_classes() -> dict[str, Path]:
    """Every class in the packages that declares prometheus metrics on a `registry=`."""
    found: dict[str, Path] = {}
    for path in sorted([*ROOT.glob("data_plane/**/*.py"), *ROOT.glob("control_plane/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for call in ast.walk(node):
                if (isinstance(call, ast.Call)
                        and getattr(call.func, "id", getattr(call.func, "attr", None)) in METRIC_TYPES
                        and any(k.arg == "registry" for k in call.keywords)):
                    found[node.name] = path
                    break
    return found


def test_catalogue_covers_every_metrics_class() -> None:
    catalogued = {type(holder).__name__ for build in PROCESSES.values() for holder in build(CollectorRegistry())}
    classes = metric_classes()
    missing = sorted(set(classes) - catalogued - set(NOT_IN_A_PROCESS_YET))
    assert not missing, (f"metrics classes {missing} are not in dashboards/catalogue.py PROCESSES: add each under "
                         "the process that exports it, then regenerate docs/metrics.md")
    sources = {p: p.read_text() for p in ROOT.glob("*_plane/**/*.py")}
    for name in set(NOT_IN_A_PROCESS_YET) & set(classes):
        users = [str(p.relative_to(ROOT)) for p, text in sources.items()
                 if p != classes[name] and re.search(rf"\b{name}\(", text)]
        assert not users, (f"{name} is now created in {users}: add it to dashboards/catalogue.py PROCESSES, "
                           "drop it from NOT_IN_A_PROCESS_YET and regenerate docs/metrics.md")
