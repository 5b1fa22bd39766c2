"""Who may talk to the coordinator: TLS on its port (mTLS when a client CA is given) and per-job
bearer tokens. This is the server's side; what callers send is `muster.security`."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from muster.coordinator.errors import PermissionDenied, Unauthenticated
from muster.security import TOKEN_METADATA

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

    def token_for(self, job: str) -> str:
        """The token a replica presents for `job` when it calls another (a relay): the job's own, else
        an operator's; "" when the file has neither."""
        return next((t for j, t in self.entries if j == job), next((t for j, t in self.entries if j == OPERATOR), ""))

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

