"""A caller's side of who may talk to the coordinator: its job's bearer token and TLS (a CA to
trust; a client certificate for mTLS). Shared by the CLI, the agents and the worker library, so
every caller sends the same credentials the same way; the coordinator's side (token checks, server
TLS) is `muster.coordinator.auth`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import grpc

from muster.net import RECONNECT_OPTIONS

TOKEN_METADATA = "authorization"  # "Bearer <token>"


def channel_credentials(ca: str, cert: str, key: str) -> grpc.ChannelCredentials | None:
    """TLS from PEM files (a CA to trust; a client certificate for mTLS); None: plaintext."""
    if not (ca or cert):
        return None
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


@dataclass(frozen=True)
class ClientSecurity:
    """A caller's credentials: a token for its job, and TLS (a CA to trust; a certificate for mTLS)."""

    token: str = field(default="", repr=False)  # never in a repr: a traceback with locals would show it
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
        return (grpc.secure_channel(address, creds, options=RECONNECT_OPTIONS) if creds
                else grpc.insecure_channel(address, options=RECONNECT_OPTIONS))

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        creds = self._credentials
        return (grpc.aio.secure_channel(address, creds, options=RECONNECT_OPTIONS) if creds
                else grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS))
