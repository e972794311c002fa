"""The `switchboard` entry point: one table of commands, subcommand tables under it."""

from __future__ import annotations

from tests.support.procs import switchboard


def test_commands_are_listed_and_unknown_ones_refused() -> None:
    listed = switchboard("--help")
    assert listed.returncode == 0
    for command in ("up", "shard", "cache-node", "gateway", "control-plane", "bench", "console"):
        assert f"  {command} " in listed.stdout
    unknown = switchboard("frobnicate")
    assert unknown.returncode == 2 and "switchboard: unknown command 'frobnicate'" in unknown.stderr


def test_bench_subcommands_use_the_same_dispatch() -> None:
    listed = switchboard("bench")
    assert listed.returncode == 0 and "usage: switchboard bench COMMAND" in listed.stdout
    assert all(f"  {name} " in listed.stdout for name in ("engine", "serve", "overhead", "tiers"))
    unknown = switchboard("bench", "nope")
    assert unknown.returncode == 2 and "switchboard bench: unknown command 'nope'" in unknown.stderr
