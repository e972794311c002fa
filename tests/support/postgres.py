"""A throwaway PostgreSQL server on a loopback port, for tests (Debian's `postgresql` package).

    with PostgresServer() as pg:            # skips the test when no PostgreSQL binaries exist
        url = pg.create_database("ledger")  # postgresql://switchboard@127.0.0.1:PORT/ledger

initdb + pg_ctl in a temp dir, trust auth on 127.0.0.1 only; run as the `postgres` user when this
process is root (PostgreSQL refuses to run as root). Stopped (fast) and removed on exit.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Self

import pytest

from tests.support.procs import free_port

USER = "switchboard"


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.port = free_port()
        self.dir: Path | None = None

    def _as_owner(self, args: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return args
        return ["runuser", "-u", "postgres", "--", *args]

    def start(self) -> Self:
        if self.bin is None:
            pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root without a postgres user")
        self.dir = Path(tempfile.mkdtemp(prefix="sb-pg-"))
        if os.geteuid() == 0:
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
        data, log = self.dir / "data", self.dir / "log"
        subprocess.run(self._as_owner([str(self.bin / "initdb"), "-D", str(data), "-U", USER, "--auth=trust",
                                       "-E", "UTF8", "--no-sync"]), check=True, capture_output=True)
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off -c max_connections=50"
        subprocess.run(self._as_owner([str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "30",
                                       "-o", options, "start"]), check=True, capture_output=True)
        return self

    @property
    def admin_url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def create_database(self, prefix: str = "t") -> str:
        import psycopg

        name = f"{prefix}_{secrets.token_hex(4)}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.dir is None or self.bin is None:
            return
        subprocess.run(self._as_owner([str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast", "-w",
                                       "stop"]), capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
