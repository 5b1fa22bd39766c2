"""The worker side of Muster: the in-process library (Worker) a training script uses to keep
training through membership changes, and the client side of the protocol (NodeSession).

The names below load on first use (PEP 562): the agent's exec wrapper and warm-start server live
in this package and must start without importing torch."""

from importlib import import_module

_EXPORTS = {"Worker": "api", "WorkerConfig": "api", "WorkerError": "errors", "FencedOut": "errors",
            "CoordinatorLost": "errors", "HoldExpired": "errors", "Drained": "errors", "RunEnded": "errors",
            "StateMismatch": "errors", "ShardedStateRefused": "errors",
            "LayoutMismatch": "errors", "Replicas": "sharded"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
