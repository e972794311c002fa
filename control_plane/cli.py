"""The `switchboard` command: one entry point, one subcommand per process or tool.

    switchboard up                      # the whole platform on embedded defaults
    switchboard shard --port 8101       # one inference shard
    switchboard stage --join 10.0.0.1:29500 --rank 1 --bind 10.0.0.2   # a pipeline stage on another host
    switchboard cache-node --port 8201  # one cache node
    switchboard gateway --port 8000     # the chat API
    switchboard control-plane           # registry + admin API
    switchboard bench engine            # engine throughput vs the naive server
    switchboard model prepare           # convert the default model once
    switchboard admin status            # members, degradation level, alerts (admin_ui/cli.py)
    switchboard keys create --tenant acme --tier plus   # a gateway API key (data_plane/gateway/keys_cli.py)

Each subcommand's module owns its flags (`main(argv)`); they are imported lazily so that
`switchboard cache-node` never pays for importing torch. Every subcommand also takes
`--tls-cert FILE --tls-key FILE --ca-bundle FILE` (TLS on its listeners, peers verified with the
bundle: data_plane/common/tls.py), listed in the --help of those where TLS applies (the servers, `up`,
`console`; `admin`: --ca-bundle).
"""

from __future__ import annotations

from data_plane.common.settings_cli import dispatch

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("control_plane.launcher", "start the whole platform (control plane, shards, cache nodes, gateway)"),
    "shard": ("data_plane.shard.app", "run one inference shard"),
    "stage": ("data_plane.shard.engines.pipeline_stage", "run a pipeline stage that joins a shard's group"),
    "cache-node": ("data_plane.cache.node", "run one cache node"),
    "gateway": ("data_plane.gateway.app", "run the OpenAI-compatible chat gateway"),
    "control-plane": ("control_plane.app", "run the control plane (membership registry, admin API)"),
    "bench": ("data_plane.bench", "benchmarks: engine, serve, overhead, tiers, multiturn, ... (`switchboard bench` lists them)"),
    "model": ("data_plane.model_cli", "model tools: prepare (convert the default model once)"),
    "dashboards": ("dashboards.cli", "Grafana dashboards: push, check (which panels fill)"),
    "console": ("admin_ui.launch", "run the admin console (Streamlit; log in with the admin token or its one-time link)"),
    "admin": ("admin_ui.cli", "operator actions over the admin API: status, members, processes, drain/undrain, degrade, tiers, usage, abuse"),
    "keys": ("data_plane.gateway.keys_cli", "gateway API keys: create (stores only its digest), list, set-tier, revoke"),
    "autoscale": ("control_plane.scaling.cli", "autoscaling tools: simulate (replay a load trace; PNG)"),
}


def main(argv: list[str] | None = None) -> None:
    import os
    import sys

    from data_plane.common.cores import SPIN_COUNT
    from data_plane.common.tls import take_tls_flags

    # Before any subcommand loads torch, and libgomp with it (it reads this once): cores.SPIN_COUNT.
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

    try:
        dispatch("switchboard", COMMANDS, take_tls_flags(list(sys.argv[1:] if argv is None else argv)))
    except BrokenPipeError:
        if not stdout_closed():
            raise  # another pipe (a socket, a child's): a real failure, with its traceback
        # The reader went away (`switchboard admin members | head -1`): it has what it wanted. Python's
        # documented handling: stdout to devnull, so the interpreter's exit flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on the writing end)."""
    import select
    import sys

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


if __name__ == "__main__":
    main()
