"""A caller's side of who may talk to the coordinator: its job's bearer token and TLS (a CA to
trust; a client certificate for mTLS). Shared by the CLI, the agents and the worker library, so
every caller sends the same credentials the same way. `TlsFiles` is every end's TLS, the
coordinator's port included; its token checks are `muster.coordinator.auth`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import grpc

from muster.net import RECONNECT_OPTIONS

TOKEN_METADATA = "authorization"  # "Bearer <token>"


def _pem(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class TlsFiles:
    """One end's TLS as PEM files: a CA (a client's: the one to trust; a server's: the one its
    clients' certificates must be signed by, for mTLS) and a certificate with its key. Every TLS
    of muster takes this shape: serving, replica to replica, to etcd, and a caller's."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def check(self, names: tuple[str, str, str]) -> TlsFiles:
        """Self, or ValueError naming the flags (or variables) `names` that gave ca, cert and key:
        at startup, not at the first connection, where the cause is buried in a retry loop."""
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"{names[1]} and {names[2]} go together: a certificate needs its private key")
        for name, path in zip(names, (self.ca, self.cert, self.key)):
            if path and not Path(path).is_file():
                raise ValueError(f"{name} {path}: no such file")
        return self

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """A client's TLS (a CA to trust; a certificate for mTLS); None: plaintext."""
        if not (self.ca or self.cert):
            return None
        return grpc.ssl_channel_credentials(_pem(self.ca), _pem(self.key), _pem(self.cert))

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server's TLS; with a CA, clients must present a certificate it signed (mTLS)."""
        root = _pem(self.ca)
        return grpc.ssl_server_credentials([(_pem(self.key), _pem(self.cert))], root_certificates=root,
                                           require_client_auth=root is not None)


@dataclass(frozen=True)
class ClientSecurity:
    """A caller's credentials: a token for its job, and TLS (a CA to trust; a certificate for mTLS)."""

    token: str = field(default="", repr=False)  # never in a repr: a traceback with locals would show it
    tls: TlsFiles = TlsFiles()

    @classmethod
    def from_env(cls, env=os.environ) -> ClientSecurity:
        tls = TlsFiles(env.get("MUSTER_TLS_CA", ""), env.get("MUSTER_TLS_CERT", ""), env.get("MUSTER_TLS_KEY", ""))
        return cls(env.get("MUSTER_TOKEN", ""), tls.check(("$MUSTER_TLS_CA", "$MUSTER_TLS_CERT", "$MUSTER_TLS_KEY")))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA, f"Bearer {self.token}"),) if self.token else ()

    @cached_property
    def _credentials(self) -> grpc.ChannelCredentials | None:
        """Read once: nodes open a channel per reconnect and per unary call."""
        return self.tls.channel_credentials()

    def channel(self, address: str) -> grpc.Channel:
        creds = self._credentials
        return (grpc.secure_channel(address, creds, options=RECONNECT_OPTIONS) if creds
                else grpc.insecure_channel(address, options=RECONNECT_OPTIONS))

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        creds = self._credentials
        return (grpc.aio.secure_channel(address, creds, options=RECONNECT_OPTIONS) if creds
                else grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS))
