"""The worker side of Muster: two programs and what they share.

- `agent/`: the node agent, `muster run` (and torchrun's rendezvous backend), with the parts of it
  that run inside a rank it started (the exec wrapper, the warm-start server, the step probe);
- `library/`: the in-process library a training script imports (`Worker`): it keeps training
  through membership changes, reforming the process group in place;
- here, both sides' wire: `node_session` (a node's stream to the coordinator), `rank_link` (a rank's
  link to its agent), `outcome` (how a run ends), `compute_clock`.

The names below load on first use (PEP 562): the agent's exec wrapper and warm-start server live
in this package and must start without importing torch."""

from importlib import import_module

_EXPORTS = {"Worker": "library.api", "WorkerConfig": "library.api", "WorkerError": "library.errors",
            "FencedOut": "library.errors", "CoordinatorLost": "library.errors", "HoldExpired": "library.errors",
            "Drained": "library.errors", "RunEnded": "library.errors", "StateMismatch": "library.errors",
            "ShardedStateRefused": "library.errors", "LayoutMismatch": "library.errors",
            "ShardLost": "library.errors", "StateLost": "library.errors", "Checkpoints": "library.checkpoints",
            "Replicas": "library.sharded", "Snapshots": "library.snapshots"}
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
