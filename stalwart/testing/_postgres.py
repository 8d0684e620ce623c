"""A throwaway PostgreSQL cluster for tests and benchmarks: initdb + pg_ctl in a temp dir.

The cluster listens on 127.0.0.1 on a free port, keeps its unix socket inside its own
directory, and is removed when stopped, or when the interpreter that started it exits
without stopping it (PostgreSQL runs detached: it would outlive the process otherwise).
PostgreSQL refuses to run as root, so when this process is root the cluster belongs to
the ``postgres`` user (or ``nobody``) and every command runs through ``runuser``. Its
superuser has a password (scram-sha-256 over TCP) so tests can check that a password
never leaks into an error or a location.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

__all__ = ["PostgresServer", "postgres_bindir"]

_SUPERUSER = "stalwart"
_PASSWORD = "s3cret-test-pw"
_START_TIMEOUT = 30


def postgres_bindir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL is absent.

    Looks on PATH, then ``pg_config --bindir``, then ``/usr/lib/postgresql/*/bin``
    (Debian's layout, newest version first).
    """
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
            if out and (Path(out) / "initdb").exists():
                return Path(out)
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0,
        reverse=True,
    )
    for candidate in candidates:
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


#: Linux's default range of the source ports of outgoing connections
_EPHEMERAL = (32768, 60999)
_LOWEST_PORT = 10000
#: how many ports a start tries when the one picked was taken before the server bound it
_PORT_TRIES = 5


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel picks the source port of an outgoing connection from."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return _EPHEMERAL


def _free_port() -> int:
    """A port nothing listens on, outside the range of outgoing connections' source ports.

    A port the kernel picked (``bind(("", 0))``) is in that range, so any connection this
    machine opened before the server bound it (a client of another test's server, a
    download) could take it, and the server failed to start: "Address already in use".
    """
    low, high = _ephemeral_ports()
    ports = [p for p in range(_LOWEST_PORT, 65536) if not low <= p <= high]
    for _ in range(100):
        port = ports[secrets.randbelow(len(ports))]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("found no free port to run PostgreSQL on")


def _run_as() -> str | None:
    """The user to run PostgreSQL as when we are root (it refuses root), else None."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists")


class PostgresServer:
    """A running throwaway cluster; use it as a context manager or call :meth:`stop`.

    ``fsync=False`` trades crash durability of the whole cluster for speed (tests);
    benchmarks keep PostgreSQL's defaults. ``url()`` names a database on it, with the
    superuser's password in it.
    """

    def __init__(
        self,
        *,
        bindir: Path | None = None,
        fsync: bool = True,
        directory: str | None = None,
        settings: Sequence[str] = (),
    ) -> None:
        found = bindir or postgres_bindir()
        if found is None:
            raise RuntimeError("PostgreSQL is not installed (no initdb and pg_ctl found)")
        self.bindir = found
        self.user = _SUPERUSER
        self.password = _PASSWORD
        self.host = "127.0.0.1"
        self.port = _free_port()
        self._owner = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix="stalwart-pg-", dir=directory))
        self.data = self.root / "data"
        self.log_file = self.root / "server.log"
        self._running = False
        self._pid = os.getpid()
        atexit.register(self._at_exit)
        if self._owner is not None:
            entry = pwd.getpwnam(self._owner)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        try:
            self._initdb()
            self._start(fsync, settings)
        except BaseException:
            self.stop()
            raise

    def _command(self, program: str, *args: str) -> list[str]:
        command = [str(self.bindir / program), *args]
        if self._owner is not None:
            command = ["runuser", "-u", self._owner, "--", *command]
        return command

    def _run(self, program: str, *args: str, timeout: float = _START_TIMEOUT) -> None:
        done = subprocess.run(
            self._command(program, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.root,
        )
        if done.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                tail = self.log_file.read_text()[-2000:]
            raise RuntimeError(
                f"{program} failed ({done.returncode}): {done.stderr.strip()[-2000:]} {tail}"
            )

    def _initdb(self) -> None:
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self._owner is not None:
            entry = pwd.getpwnam(self._owner)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        try:
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                self.user,
                f"--pwfile={pwfile}",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            )
        finally:
            pwfile.unlink()

    def _start(self, fsync: bool, settings: Sequence[str]) -> None:
        """Start the server; on another free port when the one picked was taken meanwhile
        (another test's server picked it too)."""
        for attempt in range(_PORT_TRIES):
            logged = self.log_file.stat().st_size if self.log_file.exists() else 0
            try:
                self._start_on_port(fsync, settings)
                return
            except RuntimeError:
                if not self._port_taken(logged) or attempt == _PORT_TRIES - 1:
                    raise
                self.port = _free_port()

    def _port_taken(self, logged: int) -> bool:
        """Whether the server's log after its first ``logged`` bytes says it could not
        bind its port (PostgreSQL: 'could not bind IPv4 address ...: Address already in
        use')."""
        with contextlib.suppress(OSError), open(self.log_file, "rb") as log:
            log.seek(logged)
            return b"could not bind" in log.read()
        return False

    def _start_on_port(self, fsync: bool, settings: Sequence[str]) -> None:
        options = [
            f"-c listen_addresses={self.host}",
            f"-c port={self.port}",
            f"-c unix_socket_directories={self.root}",
            "-c max_connections=200",
            "-c shared_buffers=64MB",
        ]
        if not fsync:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        options += [f"-c {setting}" for setting in settings]
        self._run(
            "pg_ctl",
            "start",
            "-D",
            str(self.data),
            "-l",
            str(self.log_file),
            "-w",
            "-t",
            str(_START_TIMEOUT),
            "-o",
            " ".join(options),
        )
        self._running = True

    def url(self, database: str = "postgres", *, password: bool = True) -> str:
        """A ``postgresql://`` URL of ``database`` on this server."""
        auth = quote(self.user, safe="")
        if password:
            auth += ":" + quote(self.password, safe="")
        return f"postgresql://{auth}@{self.host}:{self.port}/{quote(database, safe='')}"

    def create_database(self, name: str) -> str:
        """Create an empty database and return its URL."""
        import psycopg  # noqa: PLC0415 (psycopg is an optional extra)
        from psycopg import sql  # noqa: PLC0415

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def _at_exit(self) -> None:
        """Stop a server its interpreter never stopped; not in a forked child, whose
        exit must leave its parent's server running."""
        if os.getpid() == self._pid:
            self.stop()

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its directory."""
        atexit.unregister(self._at_exit)
        if self._running:
            self._running = False
            with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
                self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
