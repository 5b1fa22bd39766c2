"""Who may talk to the coordinator: per-job bearer tokens, and under mTLS the replicas' certificate
for relaying. This is the server's side; what callers send, and the TLS files of either end
(`TlsFiles`), is `muster.security`."""

from __future__ import annotations

import hmac
import os
import ssl
import stat
from collections.abc import Callable
from pathlib import Path

import structlog

from muster.coordinator.claims import MemberKeys, member_key
from muster.coordinator.errors import PermissionDenied, Unauthenticated
from muster.security import TOKEN_METADATA

OPERATOR = "*"  # a token for every job (and for listing them)
# A replica's token when it relays (the Relay call, for every job) and for nothing else: no job is
# named so. A job's token does not make its holder a relay, which the leader trusts with its nodes.
RELAY = "@relay"
# Prometheus's token: /metrics (every job's name and figures) and nothing else.
METRICS = "@metrics"

log = structlog.get_logger(__name__)
MAX_RETIRED_KEYS = 4  # proof keys of relay credentials rotated out, still accepted (`member_keys`)


class Tokens:
    """Per-job tokens, from a file of `JOB TOKEN` lines (`#` starts a comment line); job `*` is an
    operator's, `@relay` the replicas' own when they relay, `@metrics` a scraper's. `reload` reads
    the file again (SIGHUP, or `changed`): tokens rotate without a restart, and the open streams a
    token no longer covers end (`hold`)."""

    def __init__(self, entries: list[tuple[str, str]], path: str | Path = ""):
        self.entries = entries
        self.path = path
        self._seen = _signature(path) if path else None
        self._retired: tuple[bytes, ...] = ()
        self._holds: dict[object, tuple[Callable[[], None], Callable[[Exception], None]]] = {}

    @classmethod
    def load(cls, path: str | Path) -> Tokens:
        return cls(_read(path), path)

    def changed(self) -> bool:
        """The file was replaced or written since it was last read."""
        try:
            return _signature(self.path) != self._seen
        except OSError:
            return False  # gone for a moment (an atomic replace): the next look sees the new one

    def reload(self) -> bool:
        """Read the file again; one that does not load (its mode, a bad line) leaves the tokens as
        they were, and says why."""
        try:
            self._seen = _signature(self.path)
            entries = _read(self.path)
        except (OSError, ValueError) as exc:
            log.error("tokens_not_reloaded", error=str(exc))
            return False
        before = self.member_keys()
        self.entries = entries
        now = self.member_keys()
        if before is not None and (now is None or before.keys[0] != now.keys[0]):
            self._retired = (before.keys[0], *self._retired)[:MAX_RETIRED_KEYS]
        revoked = self._revoke()
        log.info("tokens_reloaded", path=str(self.path), entries=len(entries), streams_ended=revoked)
        return True

    def hold(self, check: Callable[[], None], end: Callable[[Exception], None]) -> Callable[[], None]:
        """An open stream's right to go on: after each reload `check` runs again (the stream's own
        check, with its call's token), and where it raises, `end` gets the refusal, once: a token
        rotated out revokes its streams too, not only its new calls. `check` runs now too, raising
        the refusal: the edge checked the stream, then awaited its port (a job created, an election,
        a first message), and a reload meanwhile found nothing of it to end. Returns the release
        (the stream is over). Reloads and holds are the event loop's, so no lock."""
        check()
        key = object()
        self._holds[key] = (check, end)
        return lambda: self._holds.pop(key, None)

    def _revoke(self) -> int:
        ended = 0
        for key, (check, end) in list(self._holds.items()):
            try:
                check()
            except (Unauthenticated, PermissionDenied) as exc:
                del self._holds[key]
                end(type(exc)(f"the tokens file, read again, no longer admits this stream: {exc}"))
                ended += 1
        return ended

    def relay_token(self) -> str:
        """The token a replica presents when it relays to another: the relay entry, else an
        operator's; "" when the file has neither (relaying is then refused: `check_relay`)."""
        return next((t for j, t in self.entries if j == RELAY), next((t for j, t in self.entries if j == OPERATOR), ""))

    def member_keys(self) -> MemberKeys | None:
        """The keys that sign and prove members' session secrets (`claims`): the relay credential's,
        which job token holders never see; None where the file has none (claims are unproven)."""
        credential = self.relay_token()
        if not credential:
            return None
        key = member_key(credential)
        return MemberKeys((key, *(k for k in self._retired if k != key)))

    def grants(self, metadata) -> list[str]:
        """What the call's token is for; raises where it has none the file knows. Checked before a
        stream's first message is read: a caller without a token holds no stream open."""
        token = next((v for k, v in metadata or () if k == TOKEN_METADATA), "").removeprefix("Bearer ").strip()
        if not token:
            raise Unauthenticated(f"no token: send metadata '{TOKEN_METADATA}: Bearer <token>' (MUSTER_TOKEN)")
        grants = [j for j, t in self.entries if hmac.compare_digest(t.encode(), token.encode())]
        if not grants:
            raise Unauthenticated("unknown token")
        return grants

    def check(self, metadata, job: str) -> None:
        """Raise unless the call's token may act on `job` ("": every job, operators only)."""
        grants = self.grants(metadata)
        if OPERATOR in grants or (job and job in grants):
            return
        wanted = f"job {job!r}" if job else "every job (an operator token)"
        raise PermissionDenied(f"this token is for job(s) {', '.join(sorted(grants))}, not for {wanted}")

    def check_relay(self, metadata) -> None:
        """Raise unless the call's token is a replica's (the relay entry) or an operator's."""
        grants = self.grants(metadata)
        if OPERATOR not in grants and RELAY not in grants:
            raise PermissionDenied(f"Relay is a replica's call: it needs the operator token or the tokens file's "
                                   f"{RELAY!r} entry, not a job's token")

    def check_scrape(self, metadata) -> None:
        """Raise unless the call's token is a scraper's (the `@metrics` entry) or an operator's:
        /metrics names every job, which a job's token holder may not learn."""
        grants = self.grants(metadata)
        if OPERATOR not in grants and METRICS not in grants:
            raise PermissionDenied(f"/metrics names every job: it needs the operator token or the tokens file's "
                                   f"{METRICS!r} entry, not a job's token")


def _signature(path: str | Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def private_text(path: str | Path) -> str:
    """A secret file's text; refused when group or others may read it (or write it)."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ValueError(f"{path}: mode {mode:04o} lets group or others read it; chmod 600 {path}")
    return Path(path).read_text()


def _read(path: str | Path) -> list[tuple[str, str]]:
    """The tokens file's entries (they act on every job: `private_text`)."""
    entries = []
    for number, line in enumerate(private_text(path).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):  # only a whole line is a comment: a token may hold '#'
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) < 16:
            raise ValueError(f"{path}:{number}: expected 'JOB TOKEN' with a token of 16+ characters")
        entries.append((parts[0], parts[1]))
    if not entries:
        raise ValueError(f"{path}: no tokens")
    return entries


def first_certificate(pem: bytes) -> bytes:
    """The DER of the first certificate of a PEM file (a chain's leaf)."""
    end = "-----END CERTIFICATE-----"
    return ssl.PEM_cert_to_DER_cert(pem.decode().split(end, 1)[0].strip() + "\n" + end + "\n")


def check_replica_certificate(auth_context: dict, replica_cert: bytes) -> None:
    """Under mTLS a Relay caller must present the replicas' certificate (`--peer-tls-cert`, DER in
    `replica_cert`; empty: none configured): another client's, an agent's say, is no replica."""
    presented = auth_context.get("x509_pem_cert")
    if not replica_cert or not presented or first_certificate(presented[0]) != replica_cert:
        raise PermissionDenied("Relay is a replica's call: under mTLS it needs the certificate the replicas present "
                               "to each other (--peer-tls-cert)")

