"""Which panels of a folder of Grafana dashboards show data against a live Prometheus.

    switchboard dashboards check --prometheus http://127.0.0.1:9090                 # ours (dashboards/grafana)
    switchboard dashboards check --dir ~/vllm/examples/observability/dashboards/grafana \\
        --prometheus http://127.0.0.1:9090 --range 15m                                  # anyone's, unchanged
    switchboard dashboards check --dir DIR --prometheus URL --var model_name=SmolLM2 --json

Every panel's Prometheus targets run as Grafana would run them, over the last ``--range`` (a range
query), with the template variables filled in: Grafana's own (``$__rate_interval``, ``$__interval``,
``$__range`` and their ``_s`` / ``_ms`` forms) from ``--rate-interval`` and ``--range``; a dashboard's
custom, interval, constant and textbox variables from their current value; query and datasource
variables (``$job``, ``$model_name``, ``$instance``...) as ``.*``, every value, an exact matcher on one
(``job="$job"``) becoming a regex matcher. ``--var NAME=VALUE`` overrides any of them. A panel fills
when one of its targets returns a sample that is not NaN. The report gives, per dashboard, the panels,
the panels with data and each empty panel with the metric names its queries select, those Prometheus
holds no series of marked ``absent``; exit status 1 when a query fails to run (a PromQL error).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

DASHBOARD_DIR = Path(__file__).resolve().parent / "grafana"

ALL = ".*"
"""What a query or datasource variable becomes: every value (and, as a regex, a missing label too)."""

_VAR = re.compile(r"\$\{(\w+)(?::[\w:]+)?\}|\[\[(\w+)(?::\w+)?\]\]|\$(\w+)")
_EXACT_ON_VAR = re.compile(r'(?<![=!~])([a-zA-Z_]\w*)\s*=\s*("[^"]*\$[^"]*")')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "inf", "nan", "start", "end", "le"}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> float:
    """A Prometheus duration (``90s``, ``1h30m``) in seconds; ValueError when it is not one."""
    parts = _DURATION.findall(duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(int(n) * _SECONDS[u] for n, u in parts)


def builtin_variables(rate_interval: str, window: str) -> dict[str, str]:
    """Grafana's built-in variables for a dashboard shown over the last `window`."""
    range_s = seconds(window)
    return {"__rate_interval": rate_interval, "__interval": rate_interval, "__range": window,
            "__range_s": str(int(range_s)), "__range_ms": str(int(range_s * 1000)),
            "__interval_ms": str(int(seconds(rate_interval) * 1000)), "__auto": rate_interval}


def _current(var: Mapping[str, Any]) -> str | None:
    """The value a custom / interval / constant / textbox variable shows; None for the others."""
    if var.get("type") not in ("custom", "interval", "constant", "textbox"):
        return None
    current = var.get("current") or {}
    value = current.get("value", var.get("query")) if isinstance(current, dict) else current
    values = value if isinstance(value, list) else [value]
    if not values or any(v in (None, "", "$__all", "All") for v in values):
        return ALL if var.get("type") == "custom" else None
    if var.get("type") == "interval" and values[0] == "$__auto_interval_" + str(var.get("name")):
        return None
    return "|".join(str(v) for v in values)


def dashboard_variables(board: Mapping[str, Any], builtins: Mapping[str, str],
                        overrides: Mapping[str, str]) -> dict[str, str]:
    """Name -> value for every variable a query of `board` may use (unknown names become ``.*``)."""
    values = dict(builtins)
    for var in board.get("templating", {}).get("list", []):
        shown = _current(var)
        if shown is not None:
            values[str(var["name"])] = builtins.get(shown.removeprefix("$"), shown)
    values.update(overrides)
    return values


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """`expr` with its template variables replaced; ``label="$var"`` becomes ``label=~"..."``."""
    expr = _EXACT_ON_VAR.sub(r"\1=~\2", expr)

    def value(m: re.Match[str]) -> str:
        return variables.get(m.group(1) or m.group(2) or m.group(3), ALL)
    return _VAR.sub(value, expr)


def metric_names(expr: str) -> list[str]:
    """The metric names a PromQL query selects (functions, keywords and label names left out)."""
    rest = _GROUPING.sub(" ", _STRING.sub('""', expr))
    rest = re.sub(r"\{[^{}]*\}", " ", rest)
    rest = re.sub(r"\[[^\[\]]*\]", " ", rest)
    names: list[str] = []
    for m in _IDENT.finditer(rest):
        name = m.group(1)
        if m.group(2) is None and name.lower() not in _KEYWORDS and name not in names:
            names.append(name)
    return names


def panels(board: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel with Prometheus targets, rows' nested panels included (old ``rows`` layout too)."""
    def walk(items: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            if any("expr" in t for t in panel.get("targets", [])):
                yield panel
            yield from walk(panel.get("panels", []))
    yield from walk(board.get("panels", []))
    for row in board.get("rows", []):
        yield from walk(row.get("panels", []))


class Prometheus(Protocol):
    """What the check needs from a Prometheus; :class:`HttpPrometheus` is the real one."""

    def range_query(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """The matrix of `expr` from `start` to `end`; ValueError carries Prometheus' error."""
        ...


class HttpPrometheus:
    """:class:`Prometheus` over the HTTP API at `url`."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)

    def range_query(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        response = self.http.get("/api/v1/query_range",
                                  params={"query": expr, "start": start, "end": end, "step": step})
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return list(body["data"]["result"])


@dataclass(frozen=True)
class PanelResult:
    """One panel: filled, or empty with the metrics its queries select (and which Prometheus lacks)."""

    title: str
    filled: bool
    metrics: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class BoardResult:
    """One dashboard file's panels."""

    file: str
    title: str
    panels: tuple[PanelResult, ...] = field(default_factory=tuple)

    @property
    def filled(self) -> int:
        return sum(p.filled for p in self.panels)


def _has_sample(matrix: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(v)) for series in matrix for _, v in series.get("values", []))


def check_board(prometheus: Prometheus, name: str, board: Mapping[str, Any], variables: Mapping[str, str],
                start: float, end: float, step: float, window: str) -> BoardResult:
    """Run every panel of `board`; a metric is absent when it has no series anywhere in the window."""
    results: list[PanelResult] = []
    known: dict[str, bool] = {}
    for panel in panels(board):
        filled, names, errors = False, [], []
        for target in panel.get("targets", []):
            if "expr" not in target or target.get("hide"):
                continue
            expr = substitute(str(target["expr"]), variables)
            names += [n for n in metric_names(expr) if n not in names]
            try:
                filled = _has_sample(prometheus.range_query(expr, start, end, step)) or filled
            except ValueError as exc:
                errors.append(f"[{target.get('refId', '?')}] {exc}")
        absent: list[str] = []
        if not filled:
            for n in names:
                if n not in known:
                    known[n] = _has_sample(prometheus.range_query(f"count(last_over_time({n}[{window}]))",
                                                                  end, end, step))
                if not known[n]:
                    absent.append(n)
        results.append(PanelResult(str(panel.get("title") or f"panel {panel.get('id')}"), filled,
                                   () if filled else tuple(names), tuple(absent), tuple(errors)))
    return BoardResult(name, str(board.get("title") or name), tuple(results))


def check_dir(prometheus: Prometheus, directory: Path, *, window: str = "15m", rate_interval: str = "1m",
              overrides: Mapping[str, str] | None = None, now: float | None = None) -> list[BoardResult]:
    """Every ``*.json`` dashboard in `directory`, checked over the last `window`."""
    end = time.time() if now is None else now
    start = end - seconds(window)
    step = max(1.0, seconds(window) / 120)
    builtins = builtin_variables(rate_interval, window)
    boards = []
    for path in sorted(directory.glob("*.json")):
        board = json.loads(path.read_text())
        board = board.get("dashboard", board)  # an export wrapped for the HTTP API
        variables = dashboard_variables(board, builtins, overrides or {})
        boards.append(check_board(prometheus, path.name, board, variables, start, end, step, window))
    return boards


def report(boards: Sequence[BoardResult]) -> str:
    """The text report: a line per dashboard, a line per empty panel, then the totals."""
    lines = []
    for board in boards:
        lines.append(f"{board.file} ({board.title}): {board.filled} of {len(board.panels)} panels have data")
        for p in board.panels:
            if not p.filled:
                absent = f"; absent: {', '.join(p.absent)}" if p.absent else ""
                lines.append(f"  empty: {p.title} [{', '.join(p.metrics)}{absent}]")
            lines += [f"  error: {p.title} {e}" for e in p.errors]
    filled = sum(b.filled for b in boards)
    total = sum(len(b.panels) for b in boards)
    lines.append(f"total: {filled} of {total} panels have data in {len(boards)} dashboards")
    return "\n".join(lines)


def _duration(value: str) -> str:
    try:
        seconds(value)
    except ValueError as exc:  # found only while querying, as the Prometheus URL's fault
        raise argparse.ArgumentTypeError(f"{exc} (e.g. 90s, 15m, 1h30m)") from None
    return value


def _variable(value: str) -> tuple[str, str]:
    name, eq, val = value.partition("=")
    if not eq or not name:  # was dropped unsaid
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {value!r}")
    return name, val


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchboard dashboards check",
                                     description="Which panels of Grafana dashboards show data in a Prometheus.")
    parser.add_argument("--dir", type=Path, default=DASHBOARD_DIR, help="folder of dashboard JSON (default: ours)")
    parser.add_argument("--prometheus", required=True, metavar="URL", help="e.g. http://127.0.0.1:9090")
    parser.add_argument("--range", default="15m", dest="window", type=_duration, help="the time range shown (default: 15m)")
    parser.add_argument("--rate-interval", default="1m", type=_duration, help="$__rate_interval and $__interval (default: 1m)")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", type=_variable,
                        help="a template variable's value (repeatable); unset query variables are .*")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    overrides = dict(args.var)
    if not sorted(args.dir.glob("*.json")):
        raise SystemExit(f"switchboard dashboards check: no dashboards (*.json) in {args.dir}")
    try:
        boards = check_dir(HttpPrometheus(args.prometheus), args.dir, window=args.window,
                           rate_interval=args.rate_interval, overrides=overrides)
    except (httpx.HTTPError, ValueError) as exc:
        raise SystemExit(f"switchboard dashboards check: {args.prometheus}: {type(exc).__name__}: {exc}") from None
    print(json.dumps([asdict(b) for b in boards], indent=2) if args.json else report(boards))
    if any(p.errors for b in boards for p in b.panels):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
