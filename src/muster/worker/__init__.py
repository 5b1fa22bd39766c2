"""The worker side of Muster, a folder for each process a line runs in:

- `agent/`: the node agent, `muster run`: it joins, supervises the node's slots and relays their
  reports;
- `rank/`: inside a rank `muster run` started: the warm-start zygote that forks it, the orphan
  guard between fork and exec, the runner, the step probe and the group end;
- `torchrun/`: inside torchrun: the `muster` rendezvous backend;
- `library/`: inside a training process that uses `Worker`: it keeps training through membership
  changes, reforming the process group in place; `integrations/`: the trainers over it;
- here, what they share: `node_session` (a node's stream to the coordinator), `link` and
  `rank_link` (a process's link to the coordinator or its agent), `errors`, `store` (a
  generation's sealed TCPStore values), `sockets`, `outcome` (how a run ends), `compute_clock`.

The names below load on first use (PEP 562): the agent's exec wrapper and warm-start server live
in this package and must start without importing torch."""

from importlib import import_module

_EXPORTS = {"Worker": "library.api", "WorkerConfig": "library.config", "WorkerError": "errors",
            "FencedOut": "errors", "CoordinatorLost": "errors", "HoldExpired": "errors",
            "Drained": "errors", "RunEnded": "errors", "StateMismatch": "errors",
            "ShardedStateRefused": "errors", "LayoutMismatch": "errors",
            "ShardLost": "errors", "StateLost": "errors", "Checkpoints": "library.checkpoints",
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
