"""The `switchboard` entry point: one table of commands, subcommand tables under it."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "control_plane.cli", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_commands_are_listed_and_unknown_ones_refused() -> None:
    listed = _run("--help")
    assert listed.returncode == 0
    for command in ("up", "shard", "cache-node", "gateway", "control-plane", "bench", "console"):
        assert f"  {command} " in listed.stdout
    unknown = _run("frobnicate")
    assert unknown.returncode == 2 and "switchboard: unknown command 'frobnicate'" in unknown.stderr


def test_bench_subcommands_use_the_same_dispatch() -> None:
    listed = _run("bench")
    assert listed.returncode == 0 and "usage: switchboard bench COMMAND" in listed.stdout
    assert all(f"  {name} " in listed.stdout for name in ("engine", "serve", "overhead", "tiers"))
    unknown = _run("bench", "nope")
    assert unknown.returncode == 2 and "switchboard bench: unknown command 'nope'" in unknown.stderr
