"""etcd client access: endpoints, TLS and auth, failover, and the translation of every etcd3
and gRPC error into the few this package raises, so callers never see gRPC or etcd3 types.

The etcd package is the only code that imports etcd3.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import etcd3
import etcd3.exceptions
import etcd3.watch
import grpc
import structlog
from etcd3.client import EtcdTokenCallCredentials

from muster.coordinator.errors import StoreError, StoreUnavailable
from muster.net import RECONNECT_OPTIONS
from muster.security import TlsFiles

log = structlog.get_logger(__name__)


DEFAULT_PREFIX = "/muster/v1"
# After a failure an endpoint is skipped for this long; etcd3's default (300 s)
# would turn one blip of a single-member cluster into five minutes of outage. During
# an etcd leader election every member fails requests for a moment: all endpoints are
# marked failed at once, and a session must not miss its renew deadline waiting.
_ENDPOINT_RETRY_S = 0.5
# Upper bound on any blocking wait, so stop flags and session loss are seen promptly.
POLL_S = 0.5

# python3-etcd3 0.13's watch thread calls six.itervalues() without importing
# six: when a watch stream breaks the thread dies with NameError and no callback
# hears about it. Supplying the one function it needs restores the error path.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))


class EtcdError(StoreError):
    """etcd rejected a request for a reason other than availability."""


class EtcdUnavailable(EtcdError, StoreUnavailable):
    """No etcd endpoint answered in time (down, partitioned, or without a leader)."""


class LeaseNotFound(EtcdError):
    """The lease a request referred to no longer exists in etcd."""


_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# These etcd3 errors mean the endpoint was marked failed, so a retry goes to
# another member (where every member is marked, `Client.channel` still picks one).
_FAILOVER_ERRORS = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
)
_UNAVAILABLE_ERRORS = (
    *_FAILOVER_ERRORS,
    etcd3.exceptions.WatchTimedOut,
    etcd3.exceptions.RevisionCompactedError,
)

T = TypeVar("T")


def _translate(exc: BaseException, what: str) -> EtcdError:
    if isinstance(exc, _UNAVAILABLE_ERRORS):
        return EtcdUnavailable(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        if code in _UNAVAILABLE_CODES:
            return EtcdUnavailable(f"{what}: {code}: {details}")
        if code == grpc.StatusCode.NOT_FOUND and "lease" in (details or ""):
            return LeaseNotFound(f"{what}: {details}")
        return EtcdError(f"{what}: {code}: {details}")
    return EtcdError(f"{what}: {type(exc).__name__}: {exc}")


def _token_forgotten(exc: grpc.RpcError) -> bool:
    # etcd's simple auth tokens live in its memory: a restarted member answers the old one so.
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" in (exc.details() or "")


def call(client: Client, op: Callable[[], T], what: str) -> T:
    """Run op, failing over once per endpoint, and map errors to ours.

    etcd3 never retries: it marks the endpoint failed and raises, so the next
    call picks another member. Every op passed here is safe to repeat. A token
    a restarted member forgot is renewed once, and op tried again with the new one.
    """
    attempts = max(1, len(client.endpoints))
    renewed = False
    last: BaseException | None = None
    while attempts:
        try:
            return op()
        except _FAILOVER_ERRORS as exc:
            last = exc
            attempts -= 1
        except grpc.RpcError as exc:
            if renewed or not _token_forgotten(exc):
                raise _translate(exc, what) from exc
            renewed = True
            client.renew_token()
        except etcd3.exceptions.Etcd3Exception as exc:
            raise _translate(exc, what) from exc
    assert last is not None
    raise _translate(last, what) from last


_ENDPOINT_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?):(?P<port>\d{1,5})$")
# A private etcd's client socket (`EtcdServer(private=True)`), whose file etcd names HOST:PORT.
_UNIX_ENDPOINT_RE = re.compile(r"^(?P<host>unix:/.*):(?P<port>\d{1,5})$")


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    if not isinstance(endpoint, str):
        raise ValueError(f"etcd endpoint must be a 'host:port' string, got {endpoint!r}")
    unix = _UNIX_ENDPOINT_RE.match(endpoint)
    if unix:  # etcd3 joins host and port back into gRPC's target: unix:/PATH:PORT
        return unix["host"], int(unix["port"])
    match = _ENDPOINT_RE.match(endpoint.strip())
    port = int(match["port"]) if match else 0
    if not match or not 1 <= port <= 65535:
        raise ValueError(
            f"invalid etcd endpoint {endpoint!r}: expected 'host:port' with a port "
            "in 1..65535 and no scheme, e.g. '127.0.0.1:2379'"
        )
    return match["host"], port


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach a secured etcd: TLS (a CA; a client certificate) and a user for its auth."""

    tls: TlsFiles = TlsFiles()
    user: str = ""
    password: str = field(default="", repr=False)  # never in a repr: a traceback with locals would show it
    # The embedded etcd, on a unix socket without TLS: gRPC sends the user's token only on a channel it
    # deems secure, which a local one is.
    local: bool = False


class Client(etcd3.MultiEndpointEtcd3Client):
    """etcd3's client, able to log in again (`renew_token`)."""

    def __init__(self, endpoints: list[etcd3.Endpoint], *, timeout: float, user: str | None,
                 password: str | None) -> None:
        super().__init__(endpoints, timeout=timeout, failover=True, user=user, password=password)
        self._login = etcd3.etcdrpc.AuthenticateRequest(name=user, password=password) if user else None

    @property
    def channel(self) -> grpc.Channel:
        """A member not marked failed, as etcd3 picks it; where every member is marked, the one marked
        longest ago, not etcd3's NoServerAvailableError. The mark only steers the choice among
        members: one call timed out under load would otherwise refuse every call to a lone member for
        _ENDPOINT_RETRY_S, and a member truly down fails the call itself (gRPC fails fast while it
        cannot connect)."""
        if any(not endpoint.is_failed() for endpoint in self.endpoints.values()):
            return super().channel
        label = min(self.endpoints, key=lambda each: self.endpoints[each].last_failed)
        self._current_endpoint_label = label
        return self.endpoints[label].channel

    def renew_token(self) -> None:
        """A fresh auth token, for every later call and watch stream (a restarted etcd forgot the old)."""
        if self._login is None:
            return
        try:
            token = self.authstub.Authenticate(self._login, self.timeout).token
        except grpc.RpcError as exc:
            raise _translate(exc, "etcd login") from exc
        self.metadata = (("token", token),)
        self.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(token))
        watcher = self._stubs.get("watcher")
        if watcher is not None:  # it opens its next stream with what it was made with
            watcher._credentials, watcher._metadata = self.call_credentials, self.metadata
        log.info("etcd_token_renewed", user=self._login.name)


def enable_auth(endpoint: str, password: str, timeout_s: float = 5.0) -> bool:
    """Turn on etcd's auth with user `root` (role root) and `password`; False where it is on
    already (an unauthenticated call is refused then)."""
    client = etcd3.MultiEndpointEtcd3Client([etcd3.Endpoint(*_parse_endpoint(endpoint), secure=False)],
                                            timeout=timeout_s, failover=True)
    try:
        auth = client.authstub
        try:
            auth.UserAdd(etcd3.etcdrpc.AuthUserAddRequest(name="root", password=password), timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # "user name is empty": auth is on
                return False
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # "already exists": a setup cut short
                raise
        auth.UserGrantRole(etcd3.etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout_s)
        auth.AuthEnable(etcd3.etcdrpc.AuthEnableRequest(), timeout_s)
        return True
    finally:
        client.close()


def auth_strangers(client: Client, timeout_s: float = 5.0) -> list[str]:
    """Users and roles besides `root` (a client logged in as root): whoever made them reached etcd
    before its auth was on."""
    def listed() -> tuple[list[str], list[str]]:
        creds = {"credentials": client.call_credentials, "metadata": client.metadata}
        users = client.authstub.UserList(etcd3.etcdrpc.AuthUserListRequest(), timeout_s, **creds).users
        roles = client.authstub.RoleList(etcd3.etcdrpc.AuthRoleListRequest(), timeout_s, **creds).roles
        return list(users), list(roles)
    users, roles = call(client, listed, "auth list")
    return [f"user {u}" for u in users if u != "root"] + [f"role {r}" for r in roles if r != "root"]


def connect(endpoints: Sequence[str], *, timeout_s: float = 5.0, access: EtcdAccess = EtcdAccess()) -> Client:
    """Build a client over all endpoints; a dead member is skipped by failover.

    No request is made here: unreachable clusters surface as EtcdUnavailable
    from the first real call (with auth, the first authentication happens here).
    """
    if isinstance(endpoints, (str, bytes)):
        raise ValueError(f"endpoints must be a list of 'host:port' strings, got {endpoints!r}")
    parsed = [_parse_endpoint(e) for e in endpoints]
    if not parsed:
        raise ValueError("at least one etcd endpoint is required")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    creds = (grpc.local_channel_credentials(grpc.LocalConnectionType.UDS) if access.local
             else access.tls.channel_credentials())
    client = Client(
        [etcd3.Endpoint(h, p, secure=creds is not None, creds=creds, time_retry=_ENDPOINT_RETRY_S,
                        opts=list(RECONNECT_OPTIONS)) for h, p in parsed],
        timeout=timeout_s,
        user=access.user or None,
        password=access.password or None,
    )
    log.info("etcd_client_created", endpoints=[f"{h}:{p}" for h, p in parsed], timeout_s=timeout_s,
             tls=creds is not None, user=access.user or None)
    return client
