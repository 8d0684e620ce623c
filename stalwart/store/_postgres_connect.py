"""Connecting to PostgreSQL: the URL, its password-free location, and clear errors.

A connection failure becomes a StoreError whose text is ours (what failed, where, what
to check) and never holds the password: not the URL's, nor one given as a query
parameter. The library's own message is not passed on, only its class of failure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import psycopg
import psycopg_pool

from stalwart.errors import (
    StoreClosedError,
    StoreError,
    StoreNotFoundError,
    StoreUnavailableError,
)

from ._postgres_writer import NotSentError, RefusedError

T = TypeVar("T")

DEFAULT_SCHEMA = "stalwart"
SCHEMES = ("postgresql", "postgres")
_SECRET_PARAMS = {"password", "passfile", "sslpassword"}
_MALFORMED = "the PostgreSQL store URL is malformed: its host or port cannot be read"
_AT_AFTER_HOST = (
    "the PostgreSQL store URL is malformed: it has an @ after its host; in a user name or "
    "password, write / as %2F, ? as %3F and # as %23 (and an @ in a database name as %40)"
)


class PostgresUrl:
    """A ``postgresql://`` URL split into what psycopg connects to and what we show.

    ``schema=`` in the query names the store's schema (default ``stalwart``) and is ours,
    not libpq's, so it is taken out of what psycopg sees. The rest of the URL reaches
    libpq as written: several hosts (``host1:5432,host2:5432``, libpq's failover form),
    and query values percent-encoded as libpq decodes them (``%20`` is a space, ``+`` a
    plus). Except its secrets: the store connects to :attr:`dsn`, the URL without the
    password (nor ``password``, ``sslpassword`` or ``passfile`` in the query), and passes
    them beside it as keywords (:attr:`secret_params`), so that no libpq error quoting a
    piece of the URL it could not parse (``invalid percent-encoded token: "..."``) holds
    one, nor does the exception a StoreError is raised from. The user info ends at the
    URL's last ``@``, as :attr:`location` shows it (libpq's own parser ends it at the
    first, so an ``@`` in a password made it take the password's tail for the host).
    """

    def __init__(self, url: str) -> None:
        try:
            parts = urlsplit(url)
        except ValueError:  # an unclosed IPv6 bracket; the URL is not shown
            raise StoreError(_MALFORMED) from None
        if parts.scheme not in SCHEMES:  # the URL is not shown: it may hold a password
            raise StoreError(
                "a PostgreSQL store URL starts with postgresql:// or postgres://, "
                f"found {parts.scheme or 'no scheme'!r}"
            )
        # a "+" is a plus to libpq (parse_qsl would make it a space)
        query = parse_qsl(parts.query.replace("+", "%2B"), keep_blank_values=True)
        _check_after_host(parts.path, parts.fragment, query)
        userinfo, _, hostlist = parts.netloc.rpartition("@")
        hosts = [_host(host) for host in hostlist.split(",")] if hostlist else [""]
        user, _, password = userinfo.partition(":")
        schema = DEFAULT_SCHEMA
        self.password = unquote(password) if password else None
        secret: dict[str, Any] = {} if self.password is None else {"password": self.password}
        kept: list[tuple[str, str]] = []
        for key, value in query:
            if key == "schema":
                schema = value
            elif key in _SECRET_PARAMS:
                secret[key] = value  # a later one wins, as in libpq
            else:
                kept.append((key, value))
        _check_schema(schema)
        self.schema = schema
        #: the libpq parameters the URL sets itself (the store's defaults do not override
        #: them: ``connect_timeout``, the TCP keepalives, ``tcp_user_timeout``)
        self.own_params = frozenset(key for key, _ in kept)
        named = quote(unquote(user), safe="")
        #: what the store connects to: the URL without ``schema=`` and without its secrets
        self.dsn = urlunsplit(
            parts._replace(
                netloc=f"{named}@{hostlist}" if user else hostlist,
                query=urlencode(kept, quote_via=quote),
            )
        )
        #: the URL's secrets, passed to libpq beside :attr:`dsn` as keywords
        self.secret_params = secret
        #: the whole URL as libpq reads it, secrets in it, for a tool that connects by
        #: hand (the store itself connects to :attr:`dsn` with :attr:`secret_params`)
        libpq = [(key, value) for key, value in query if key != "schema"]
        self.conninfo = urlunsplit(parts._replace(query=urlencode(libpq, quote_via=quote)))
        shown = [(k, v) for k, v in query if k not in _SECRET_PARAMS]
        netloc = ",".join(hosts)
        if user:
            netloc = f"{named}@{netloc}"
        self.location = urlunsplit(
            (parts.scheme, netloc, parts.path, urlencode(shown, quote_via=quote), "")
        )
        self.secrets = [s for s in (self.password, *_query_secrets(query)) if s]

    def scrub(self, text: str) -> str:
        """``text`` with every secret of this URL replaced by ``***``."""
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


def _check_after_host(path: str, fragment: str, query: list[tuple[str, str]]) -> None:
    """A StoreError, the URL not shown, when an ``@`` follows the host where no libpq URL
    has one (the database name, a parameter's name, a fragment): a password with a ``/``,
    ``?`` or ``#`` in it ends the host there (``agent:/pw@db``: host ``agent``), and the
    rest of the password was shown as the database or a parameter, in errors and logs."""
    if "@" in path or "@" in fragment or any("@" in key for key, _ in query):
        raise StoreError(_AT_AFTER_HOST)


def _check_schema(schema: str) -> None:
    """A schema name PostgreSQL takes (it is quoted, so any other character is fine), or a
    StoreError saying why not, before any connection: otherwise the server's error class
    (``ReservedName``, ``DataError``) would be all the user sees."""
    try:
        size = len(schema.encode())
    except UnicodeEncodeError:  # undecodable bytes in argv or the environment
        raise StoreError("the store's schema name must be valid UTF-8") from None
    if not schema or size > 50:
        raise StoreError("the store's schema name must have 1 to 50 bytes")
    if "\x00" in schema:
        raise StoreError("the store's schema name cannot hold a NUL character")
    if schema.startswith("pg_"):  # as the server checks it: case-sensitive
        raise StoreError("the store's schema name cannot start with pg_ (PostgreSQL's own)")


def _host(host: str) -> str:
    """One ``host[:port]`` of the URL's host list, checked (an IPv6 host in brackets)."""
    try:
        checked = urlsplit(f"//{host}")
        port = checked.port  # a bad port raises
    except ValueError:
        raise StoreError(_MALFORMED) from None
    if host and not checked.hostname:
        raise StoreError(_MALFORMED)
    name = checked.hostname or ""
    if ":" in name:
        name = f"[{name}]"
    return name if port is None else f"{name}:{port}"


def _query_secrets(query: list[tuple[str, str]]) -> list[str]:
    return [value for key, value in query if key in _SECRET_PARAMS and value]


def _reason(exc: BaseException) -> str:
    """A static sentence for a connection failure's class.

    libpq's message names hosts, socket paths, users and databases in double quotes;
    they are blanked before the server's phrases are looked for, so that a host or a
    socket directory called ``authentication-db`` says nothing about the failure."""
    text = re.sub(r'"[^"]*"', '""', str(exc).lower())
    if "authentication failed" in text:
        return "authentication failed: check the user name and password"
    if "no password supplied" in text:
        return "the server asks for a password and none was given"
    if 'database "" does not exist' in text:
        return "the database does not exist: create it first (createdb)"
    if 'role "" does not exist' in text:
        return "the user does not exist on the server"
    if "is not permitted to log in" in text:
        return "the user may not log in (the role has NOLOGIN)"
    if "pg_hba.conf" in text:
        return "the server's pg_hba.conf does not let this client in"
    if "timeout expired" in text or "timed out" in text:
        return "the connection timed out"
    if "connection refused" in text or "could not connect" in text or "no such file" in text:
        return "nothing is listening there: is the server running, and the host and port right?"
    if "could not translate host name" in text or "name or service not known" in text:
        return "the host name does not resolve"
    return f"the connection failed ({type(exc).__name__})"


#: the reasons of a refused connection that waiting does not mend: the server answers,
#: and says no to these credentials, this role, this database or this client
_REFUSED = (
    "authentication",
    "the server asks",
    "the database does",
    "the user ",
    "the server's pg_hba",
)


def refused(exc: BaseException) -> str | None:
    """The static reason when the server itself refused a connection (credentials, role,
    database, pg_hba.conf), else None (it could not be reached: that may pass)."""
    reason = _reason(exc)
    return reason if reason.startswith(_REFUSED) else None


def connect_error(exc: BaseException, url: PostgresUrl) -> StoreError:
    """A typed, password-free error for a failed connection."""
    reason = _reason(exc)
    kind = StoreNotFoundError if reason.startswith("the database does not exist") else StoreError
    return kind(url.scrub(f"cannot connect to the PostgreSQL store at {url.location}: {reason}"))


def connect(url: PostgresUrl, *, timeout: float, **kwargs: Any) -> psycopg.Connection[Any]:
    """One autocommit connection, or a clear StoreError."""
    try:
        return psycopg.connect(
            url.dsn, autocommit=True, **url.secret_params, **_defaults(url, timeout), **kwargs
        )
    except psycopg.Error as exc:
        raise connect_error(exc, url) from exc


#: libpq's TCP settings on every connection the store opens, unless the URL sets its own
#: (docs/scaling.md, "A connection that goes quiet"): a database that stops answering
#: without closing the connection (a partition, a firewall or NAT that forgot it) is
#: noticed within about 30 s, and the statement waiting on it fails as a lost connection.
#: An idle connection is probed after 10 s of silence, then every 5 s, 4 times; data left
#: unacknowledged for 30 s gives it up too (on Linux that also caps the probes). libpq's
#: own defaults are the system's: a first probe after 2 hours, unacknowledged data retried
#: for about 15 minutes. A slow statement is not cut (the server's kernel answers the
#: probes), and the probes keep a firewall's idle timeout from dropping a pooled
#: connection. A Unix-domain socket ignores them.
TCP_DEFAULTS: dict[str, str] = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "4",
    "tcp_user_timeout": "30000",
}
#: libpq learned ``tcp_user_timeout`` in version 12; an older one refuses the option
_USER_TIMEOUT_SINCE = 120000


def _defaults(url: PostgresUrl, timeout: float) -> dict[str, Any]:
    """The libpq parameters the store sets: ``connect_timeout`` and :data:`TCP_DEFAULTS`,
    each only when the URL does not set it itself (the URL's value wins)."""
    params: dict[str, Any] = {"connect_timeout": max(1, round(timeout)), **TCP_DEFAULTS}
    if psycopg.pq.version() < _USER_TIMEOUT_SINCE:
        del params["tcp_user_timeout"]
    return {key: value for key, value in params.items() if key not in url.own_params}


#: SQLSTATEs of a session the server ended (admin shutdown, crash shutdown, cannot
#: connect now); class 08 is a connection exception. Other operational errors (a
#: statement timeout, a lock timeout, a serialization failure) leave the session alive
#: and the transaction rolled back.
_GONE = ("57P01", "57P02", "57P03")
#: the severities of a server error that ends the session (PostgreSQL closes it after
#: sending one): ``idle_session_timeout`` (57P05), ``idle_in_transaction_session_timeout``
#: and any other reason, whatever its SQLSTATE
_ENDS_SESSION = ("FATAL", "PANIC")


def gone(exc: psycopg.Error) -> bool:
    """Whether an error means the connection itself is gone: the server ended the session
    (a FATAL error, whatever its SQLSTATE), or an operational error of a connection."""
    diag = exc.diag
    if (diag.severity_nonlocalized or diag.severity) in _ENDS_SESSION:
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False  # a client-side error has no SQLSTATE either: not a lost connection
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _GONE


def lost(exc: StoreError) -> bool:
    """Whether a StoreError is a connection that broke or that the server closed."""
    cause = exc.__cause__
    return (
        isinstance(cause, psycopg.Error)
        and not isinstance(cause, psycopg_pool.PoolTimeout | psycopg_pool.PoolClosed)
        and gone(cause)
    )


#: how long the pool keeps trying to replace a connection that broke, with its backoff
#: (1 s, then 2 s, 4 s... between tries), before it forgets that slot; the next request
#: that finds no connection opens one at once, and one already waiting has the pool try
#: again at once (:func:`_try_again_if_waited_for`). psycopg_pool's default, 5 minutes,
#: let the backoff outgrow an outage: after 20 s without the database, the store stayed
#: out of reach 9 s longer than the database did.
RECONNECT_S = 2.0


def _try_again_if_waited_for(pool: psycopg_pool.ConnectionPool[Any]) -> None:
    """psycopg_pool gave up replacing a connection (after :data:`RECONNECT_S`): while a
    request waits for one, start another round of tries at once (``check`` grows the
    pool), or it would wait out its whole timeout though the server may be back."""
    if pool.get_stats().get("requests_waiting", 0):
        pool.check()


class Connections:
    """A store handle's pool of autocommit connections, with its failures made StoreErrors.

    The messages name the store's password-free location and what was being done.
    """

    def __init__(self, url: PostgresUrl, *, pool_size: int, timeout: float) -> None:
        self._location = url.location
        self._timeout = timeout
        #: why the pool's last attempt to connect failed (None once one succeeds)
        self.connect_failure: BaseException | None = None
        self._pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] = (
            psycopg_pool.ConnectionPool(
                url.dsn,
                connection_class=self._recording_class(),
                kwargs={"autocommit": True, **url.secret_params, **_defaults(url, timeout)},
                min_size=1,
                max_size=pool_size,
                open=False,
                num_workers=1,
                timeout=timeout,
                reconnect_timeout=RECONNECT_S,
                reconnect_failed=_try_again_if_waited_for,
                name="stalwart-pg",
            )
        )
        self._pool.open(wait=False)

    def _recording_class(self) -> type[psycopg.Connection[Any]]:
        """A connection class whose ``connect`` tells this handle how it went, so that a
        wait for a pooled connection can say why there was none."""
        handle = self

        class Recorded(psycopg.Connection[Any]):
            @classmethod
            def connect(cls, *args: Any, **kwargs: Any) -> Any:
                try:
                    conn = super().connect(*args, **kwargs)
                except BaseException as exc:
                    handle.connect_failure = exc
                    raise
                handle.connect_failure = None
                return conn

        return Recorded

    @property
    def timeout(self) -> float:
        """How long a pooled connection is waited for, unless a call says less."""
        return self._timeout

    @contextmanager
    def connection(
        self, doing: str, wait: float | None = None
    ) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection, waited for ``wait`` seconds (default: the handle's
        timeout); a failure becomes a StoreError naming what was being done."""
        where = self._location
        within = self._timeout if wait is None else min(wait, self._timeout)
        try:
            with self._pool.connection(timeout=within) as conn:
                yield conn
        except psycopg_pool.PoolClosed as exc:
            raise StoreClosedError(f"the store at {where} is closed") from exc
        except psycopg_pool.PoolTimeout as exc:
            failure = self.connect_failure
            reason = None if failure is None else refused(failure)
            if reason is not None:  # the server answers, and refuses: waiting won't mend it
                raise RefusedError(f"cannot connect to the store at {where}: {reason}") from exc
            raise NotSentError(
                f"no connection to the store at {where} within {within:g} s "
                f"to {doing}: is the server up?"
            ) from exc
        except psycopg.Error as exc:
            if gone(exc):
                raise StoreUnavailableError(
                    f"lost the connection to the store at {where} while trying to {doing} "
                    f"({type(exc).__name__})"
                ) from exc
            if isinstance(exc, psycopg.OperationalError):  # refused; nothing was written
                raise StoreError(
                    f"the store at {where} could not {doing}: {type(exc).__name__} "
                    f"({exc.sqlstate}); nothing was written"
                ) from exc
            raise StoreError(
                f"the store at {where} could not {doing}: {type(exc).__name__} ({exc.sqlstate})"
            ) from exc

    def fetch(
        self, doing: str, query: Any, params: Sequence[Any] = (), wait: float | None = None
    ) -> list[Any]:
        """Run a read; a connection the server closed is replaced and the read run again."""

        def read(conn: psycopg.Connection[Any]) -> list[Any]:
            with conn.cursor(binary=True) as cursor:
                cursor.execute(query, params)
                return cursor.fetchall()

        return self.again(doing, read, wait)

    def again(
        self, doing: str, work: Callable[[psycopg.Connection[Any]], T], wait: float | None = None
    ) -> T:
        """``work(connection)``; when the server had closed that connection, once more on
        a new one. Only for work that may safely run twice (a read, an upsert)."""
        for attempt in (1, 2):
            try:
                with self.connection(doing, wait) as conn:
                    return work(conn)
            except StoreError as exc:
                if attempt == 2 or not lost(exc):
                    raise
                self.check()
        raise AssertionError("unreachable")

    def check(self) -> None:
        """Drop every idle pooled connection that no longer works."""
        self._pool.check()

    def close(self) -> None:
        self._pool.close(timeout=self._timeout)
