"""Who may talk to the coordinator: TLS on its port (mTLS when a client CA is given) and per-job
bearer tokens. The client side (`ClientSecurity`) is shared by the CLI, the agents and the
worker library, so every caller sends the same credentials the same way."""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import grpc

from muster.coordinator.errors import PermissionDenied, Unauthenticated

TOKEN_METADATA = "authorization"  # "Bearer <token>"
OPERATOR = "*"  # a token for every job (and for listing them)


class Tokens:
    """Per-job tokens, from a file of `JOB TOKEN` lines (`#` comments); job `*` is an operator's."""

    def __init__(self, entries: list[tuple[str, str]]):
        self.entries = entries

    @classmethod
    def load(cls, path: str | Path) -> Tokens:
        entries = []
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or len(parts[1]) < 16:
                raise ValueError(f"{path}:{number}: expected 'JOB TOKEN' with a token of 16+ characters")
            entries.append((parts[0], parts[1]))
        if not entries:
            raise ValueError(f"{path}: no tokens")
        return cls(entries)

    def check(self, metadata, job: str) -> None:
        """Raise unless the call's token may act on `job` ("": every job, operators only)."""
        token = next((v for k, v in metadata or () if k == TOKEN_METADATA), "").removeprefix("Bearer ").strip()
        if not token:
            raise Unauthenticated(f"no token: send metadata '{TOKEN_METADATA}: Bearer <token>' (MUSTER_TOKEN)")
        grants = [j for j, t in self.entries if hmac.compare_digest(t.encode(), token.encode())]
        if not grants:
            raise Unauthenticated("unknown token")
        if OPERATOR in grants or (job and job in grants):
            return
        wanted = f"job {job!r}" if job else "every job (an operator token)"
        raise PermissionDenied(f"this token is for job(s) {', '.join(sorted(grants))}, not for {wanted}")


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS for the coordinator's port; with `client_ca`, clients must present a certificate it signed."""
    root = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())],
                                       root_certificates=root, require_client_auth=root is not None)


def channel_credentials(ca: str, cert: str, key: str) -> grpc.ChannelCredentials | None:
    """TLS from PEM files (a CA to trust; a client certificate for mTLS); None: plaintext."""
    if not (ca or cert):
        return None
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


@dataclass(frozen=True)
class ClientSecurity:
    """A caller's credentials: a token for its job, and TLS (a CA to trust; a certificate for mTLS)."""

    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_env(cls, env=os.environ) -> ClientSecurity:
        return cls(env.get("MUSTER_TOKEN", ""), env.get("MUSTER_TLS_CA", ""), env.get("MUSTER_TLS_CERT", ""),
                   env.get("MUSTER_TLS_KEY", ""))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA, f"Bearer {self.token}"),) if self.token else ()

    @cached_property
    def _credentials(self) -> grpc.ChannelCredentials | None:
        """Read once: nodes open a channel per reconnect and per unary call."""
        return channel_credentials(self.tls_ca, self.tls_cert, self.tls_key)

    def channel(self, address: str) -> grpc.Channel:
        creds = self._credentials
        return grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        creds = self._credentials
        return grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
