"""`switchboard dashboards check`'s template-variable filling and metric naming (pure functions); the
checker against a real Prometheus runs in tests/observability/test_vllm_dashboards.py.

    .venv/bin/python -m pytest tests/observability/test_check.py -q      # < 1 s
"""

from __future__ import annotations

import pytest

from dashboards.check import builtin_variables, dashboard_variables, metric_names, panels, seconds, substitute


def test_grafana_builtins_and_custom_variables_are_filled() -> None:
    builtins = builtin_variables("1m", "15m")
    assert builtins["__range_s"] == "900" and builtins["__interval_ms"] == "60000"
    board = {"templating": {"list": [
        {"name": "job", "type": "query", "current": {"value": ["$__all"]}},
        {"name": "ttft_slo", "type": "custom", "current": {"text": "1s", "value": "1.0"}},
        {"name": "models", "type": "custom", "current": {"value": ["a", "b"]}},
        {"name": "step", "type": "interval", "current": {"value": "$__auto_interval_step"}},
    ]}}
    values = dashboard_variables(board, builtins, {"job": "switchboard-shard"})
    assert values["ttft_slo"] == "1.0" and values["models"] == "a|b" and values["job"] == "switchboard-shard"
    assert "step" not in values  # auto interval: left to the default (.*) like any unknown name
    expr = ('sum(rate(x_bucket{job=~"$job", model_name="$model_name", le="${ttft_slo}"}[$__rate_interval]))'
            ' / [[models]]')
    assert substitute(expr, values) == ('sum(rate(x_bucket{job=~"switchboard-shard", model_name=~".*", '
                                        'le=~"1.0"}[1m])) / a|b')


def test_metric_names_leave_out_functions_labels_and_keywords() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, instance) (rate(vllm:ttft_seconds_bucket{job=~".*"}[1m])))'
            ' / on () group_left () (sum(vllm:num_requests_running) > 0) or vector(0) + up')
    assert metric_names(expr) == ["vllm:ttft_seconds_bucket", "vllm:num_requests_running", "up"]


def test_panels_inside_rows_and_without_queries() -> None:
    board = {"panels": [{"type": "row", "panels": [{"title": "in a row", "targets": [{"expr": "up"}]}]},
                        {"title": "text", "type": "text"}, {"title": "top", "targets": [{"expr": "up"}]}],
             "rows": [{"panels": [{"title": "old layout", "targets": [{"expr": "up"}]}]}]}
    assert [p["title"] for p in panels(board)] == ["in a row", "top", "old layout"]


def test_durations() -> None:
    assert seconds("1h30m") == 5400 and seconds("90s") == 90
    with pytest.raises(ValueError):
        seconds("soon")


@pytest.mark.parametrize("flag, value, said", [("--range", "xyz", "not a duration"),
                                               ("--rate-interval", "1 minute", "not a duration"),
                                               ("--var", "model_name", "NAME=VALUE")])
def test_a_bad_argument_is_a_usage_error_before_any_query(flag: str, value: str, said: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`--range xyz` was found only while querying, and said so as the Prometheus URL's fault
    ("http://...: ValueError: not a duration"), exit 1; `--var model_name` (no =) was dropped unsaid."""
    from dashboards.check import main

    with pytest.raises(SystemExit) as exc:
        main(["--prometheus", "http://127.0.0.1:9", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}" in err and said in err and "127.0.0.1:9" not in err, err
