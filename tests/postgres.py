"""A real PostgreSQL server for tests: one per session, a fresh database per test.

`postgres_url` (session) starts a throwaway cluster with the PostgreSQL binaries on this
machine (`initdb`, `pg_ctl`): under /tmp, listening only on 127.0.0.1 on a free port, trust
authentication, no fsync; it is stopped and deleted at the end of the session. PostgreSQL
refuses to run as root, so as root the server runs as the `postgres` user. `fresh_postgres`
gives each test a database of its own (`new_database` makes one for a wider scope). Tests that
use them are skipped, saying why, where no PostgreSQL binaries are installed (or, as root,
where there is no `postgres` user to run them as).

Use them from a test folder's conftest.py: `from tests.postgres import fresh_postgres,
postgres_url  # noqa: F401`.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from .ports import free_port

_names = itertools.count()


def _binaries() -> str | None:
    """The folder holding initdb and pg_ctl, or None."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl", path=os.path.dirname(found)):
        return os.path.dirname(found)
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(folder, "pg_ctl")):
            return folder
    return None


class Cluster:
    """A throwaway PostgreSQL cluster; `durable=False` (tests) turns off fsync and commit waits."""

    def __init__(self, bin_dir: str, durable: bool = False):
        self.bin = bin_dir
        self.durable = durable
        self.root = tempfile.mkdtemp(prefix="expresslane-pg-", dir="/tmp")
        self.data = os.path.join(self.root, "data")
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # the server must not run as root: as `postgres`
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            os.chmod(self.root, 0o700)
            runuser = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin")
            self.as_user = [runuser or "runuser", "-u", "postgres", "--"]
        self.port, self.url = 0, ""

    def _run(self, tool: str, *args: str) -> None:
        cmd = [*self.as_user, os.path.join(self.bin, tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.root)
        if done.returncode != 0:
            log = Path(self.root, "log")
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{tool} failed: {done.stderr.strip()}\n{tail}")

    def start(self) -> None:
        self._run("initdb", "-D", self.data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--no-locale", "--no-sync")  # fmt: skip
        log = os.path.join(self.root, "log")
        for attempt in range(3):  # the free port may be taken before the server binds it
            self.port = free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                f"-c unix_socket_directories={self.root} -c max_connections=200"
            )
            if not self.durable:
                options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            self.options = options  # start_again needs them too
            try:
                self._run("pg_ctl", "-D", self.data, "-l", log, "-o", options, "-w", "-t", "60",
                          "start")  # fmt: skip
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def restart(self) -> None:
        """Crash and start again on the same port."""
        self.crash()
        self.start_again()

    def crash(self) -> None:
        """Stop the server at once (`-m immediate`: no checkpoint first), keeping its data."""
        self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")

    def start_again(self) -> None:
        log = os.path.join(self.root, "log")
        self._run("pg_ctl", "-D", self.data, "-l", log, "-o", self.options, "-w", "-t", "60",
                  "start")  # fmt: skip

    def stop(self) -> None:
        try:
            if os.path.exists(os.path.join(self.data, "postmaster.pid")):  # it is running
                self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def running_cluster():
    """A started `Cluster` of its own (skipping the test where PostgreSQL cannot run)."""
    bin_dir = _binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb/pg_ctl on PATH or in /usr/lib)")
    if os.geteuid() == 0 and not _has_user("postgres"):
        pytest.skip("running as root, and there is no 'postgres' user to run PostgreSQL as")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.fail("psycopg is not installed: pip install -e '.[test]' (or '.[postgres]')")
    cluster = Cluster(bin_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def postgres_url():
    """The URL of a running throwaway PostgreSQL server (its `postgres` database)."""
    with running_cluster() as cluster:
        yield cluster.url


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def new_database(server_url: str) -> str:
    """Create an empty database on the server; its URL."""
    import psycopg

    name = f"test_{os.getpid()}_{next(_names)}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + "/" + name


def drop_database(url: str) -> None:
    import psycopg

    server, name = url.rsplit("/", 1)
    with psycopg.connect(server + "/postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def fresh_postgres(postgres_url):
    """A new, empty database for this test (dropped after it)."""
    url = new_database(postgres_url)
    yield url
    drop_database(url)
