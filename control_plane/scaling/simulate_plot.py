"""The autoscaling simulation as a three-panel PNG: load vs capacity, replicas, TTFT p95 vs the SLO.

    plot(simulate(load_trace("ramp.csv"), PolicyConfig(max_replicas=6), ShardModel()), "sim.png")

Called by ``switchboard autoscale simulate`` (control_plane/scaling/cli.py); every scaling decision
is marked on the replicas panel. Needs matplotlib (``pip install matplotlib``; the ``sim`` extra),
imported when called.
"""

from __future__ import annotations

import math
from pathlib import Path

from control_plane.scaling.simulate import SimResult


def plot(result: SimResult, out: str | Path, title: str = "") -> None:
    """A three-panel PNG: load vs capacity, replicas, TTFT p95 vs SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result.config
    t = result.t
    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [1.1, 1, 1.1]}
    )
    if not all(math.isnan(v) for v in result.arrival_rate):
        ax1.plot(t, result.arrival_rate, color="tab:blue", lw=2, label="arrivals (req/s)")
        ax1.plot(
            t,
            result.capacity_rps,
            color="tab:green",
            lw=1.5,
            ls="--",
            label="capacity of serving shards (req/s)",
        )
        ax1.set_ylabel("requests / s")
    else:
        ax1.plot(
            t,
            [w * r for w, r in zip(result.waiting_per_shard, result.ready, strict=True)],
            color="tab:blue",
            lw=2,
            label="waiting (replayed)",
        )
        ax1.set_ylabel("requests waiting")
    ax1.set_title(
        title or "Autoscaling simulation: the real TargetTracking policy on a fluid shard model", fontsize=12
    )
    ax1.set_ylim(0, max(max(result.capacity_rps, default=1.0), 1.0) * 1.3)
    ax1.legend(loc="upper right", fontsize=9, ncol=2)
    ax1.grid(alpha=0.3)

    ax2.step(t, result.desired, where="post", color="tab:orange", lw=2, label="replicas asked for")
    ax2.step(t, result.ready, where="post", color="tab:purple", lw=1.5, ls="--", label="replicas serving")
    ax2.axhline(cfg.max_replicas, color="grey", ls=":", lw=1)
    ax2.axhline(cfg.min_replicas, color="grey", ls=":", lw=1)
    ax2.text(t[-1], cfg.max_replicas, "max ", ha="right", va="bottom", fontsize=8, color="grey")
    ax2.text(t[-1], cfg.min_replicas, "min ", ha="right", va="bottom", fontsize=8, color="grey")
    for d in result.decisions:
        up = d["to"] > d["from"]
        ax2.annotate(
            "▲" if up else "▼",
            (d["t"], d["to"]),
            color="tab:red" if up else "tab:blue",
            ha="center",
            va="bottom" if up else "top",
            fontsize=10,
        )
    ax2.set_ylabel("shards")
    ax2.set_ylim(0, cfg.max_replicas + 2)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.legend(loc="upper right", fontsize=9, ncol=2)
    ax2.grid(alpha=0.3)

    ttft = [math.nan if v is None else v for v in result.ttft_p95_s]
    ax3.plot(t, ttft, color="tab:red", lw=2, label="TTFT p95 (window)")
    ax3.axhline(cfg.ttft_slo_s, color="black", ls="--", lw=1.2, label=f"SLO {cfg.ttft_slo_s:g} s")
    ax3.fill_between(
        t,
        cfg.ttft_slo_s,
        ttft,
        where=[v > cfg.ttft_slo_s for v in ttft],
        color="tab:red",
        alpha=0.15,
        interpolate=True,
    )
    ax3.set_ylabel("seconds")
    ax3.set_xlabel("time (s)")
    finite = [v for v in ttft if not math.isnan(v)]
    ax3.set_ylim(0, max(cfg.ttft_slo_s * 2.5, min(max(finite, default=1.0) * 1.3, cfg.ttft_slo_s * 8)))
    ax3.legend(loc="upper right", fontsize=9, ncol=2)
    ax3.grid(alpha=0.3)

    s = result.summary()
    note = (
        f"target waiting/shard {cfg.target_waiting_per_shard:g} · "
        f"cooldowns up {cfg.scale_up_cooldown_s:g}s / "
        f"down {cfg.scale_down_cooldown_s:g}s · shard: {result.model.slots} slots × "
        f"{result.model.service_time_s:g}s, ready after {result.model.startup_s:g}s · "
        f"over SLO {s['share_of_time_over_slo']:.0%} of the time"
    )
    fig.text(0.5, 0.005, note, ha="center", fontsize=8.5, color="dimgrey")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
