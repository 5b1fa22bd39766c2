"""torchrun's rendezvous backend `muster`: unmodified scripts, plain torchrun restart semantics,
membership from the Muster coordinator (etcd-backed, no single point of failure).

    torchrun --rdzv-backend=muster --rdzv-endpoint=HOST:PORT[,HOST:PORT] --rdzv-id=JOB \\
             --nnodes=1:4 --nproc-per-node=8 --max-restarts=10 train.py

Each torchrun agent is one node of the job. A rendezvous round is a generation: the node's rank
and the number of nodes come from the rank map, the round's store is a fresh prefix on the store
of the node holding rank 0, and the workers' MASTER_ADDR/MASTER_PORT are published inside that
prefix with use_agent_store=False: restarted workers never read the previous round's keys (the
shared agent store of torch 2.13 hands them stale addresses). A new round that the coordinator
has not started yet (this node's own workers failed) is asked for at once by reporting the node
as restarting in place: the leader re-forms the job once with it, however many nodes ask. Only a
node the coordinator does not re-form that way (no place in the map) leaves and joins again,
after `rejoin_after` seconds (rdzv-conf, default 3).

A job ends once: once the leader says it is finishing (a rank finished its script, a node left as
finished) or its run ended, no new round starts, whatever asks for one; torchrun ends instead
(`_end_if_ending`). torchrun cannot tell this backend whether its workers completed their script
before they failed, so a node whose workers failed then exits 1.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import grpc
import structlog
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousHandler, RendezvousInfo,
                                                  RendezvousParameters, RendezvousStoreInfo,
                                                  RendezvousTimeoutError)

from muster.net import address_towards, reserve_port, split_host_port
from muster.security import ClientSecurity
from muster.v1 import muster_pb2 as pb
from muster.worker.store import Seal, publish, serve
from muster.names import job_name
from muster.worker.link import Link
from muster.worker.node_session import NodeIdentity, NodeSession
from muster.worker.outcome import EXIT_FAILED, EXIT_SUCCEEDED, exit_code

log = structlog.get_logger(__name__)

EXIT_REPORT_WAIT_S = 2.0  # for the exit report of workers that failed as the job finished to leave in a frame


class MusterRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters, security: ClientSecurity):
        self._run_id = params.run_id  # torchrun's --rdzv-id, as given (TORCHELASTIC_RUN_ID)
        self._job = job_name(params.run_id)  # the coordinator's name for it (lowercase [a-z0-9._-])
        if self._job != self._run_id:
            log.info("rdzv_job_name_mapped", rdzv_id=self._run_id, job=self._job)
        self._addresses = params.endpoint
        self._security = security
        # As `muster run` picks it: the address on the route to the coordinator (torchrun's --local-addr wins)
        self._host = params.local_addr or address_towards([a.strip() for a in params.endpoint.split(",") if a.strip()])
        self._spec = pb.JobSpec(min_nodes=params.min_nodes, max_nodes=params.max_nodes)
        self._join_timeout_s = float(params.get("join_timeout", 600))
        self._rejoin_after_s = float(params.get("rejoin_after", 3.0))
        self._server = serve(self._host, timedelta(seconds=self._join_timeout_s))
        self._master_port: socket.socket | None = None  # this round's MASTER_PORT, held (`reserve_port`)
        self._generation = 0
        self._rounds = 0
        self._closed = False
        self._restarting_in = 0  # this node's workers failed in this generation: a new round is asked for
        self._workers_ended = False  # a round after the first is asked for: this node's workers ended
        self._link = Link("muster-rdzv", on_directive=self._on_directive)
        self._join()

    # ---- the link --------------------------------------------------------------------

    def _join(self) -> None:
        """A new membership (a new member id): the coordinator makes a new generation with it."""
        if self._link.session is not None:
            try:
                self._link.leave(immediate=True, reason="this node's workers need a new round")
            except Exception as exc:  # it may be evicted already
                log.info("rdzv_leave_failed", error=str(exc))
        # (the old session stopped, its mailbox emptied)
        self._link.open(self._connect, joined=True, join_timeout_s=self._join_timeout_s)

    def _connect(self, on_directive) -> NodeSession:
        return NodeSession(
            self._addresses,
            NodeIdentity(self._job, f"{socket.gethostname()}-{os.getpid()}", 1, self._host, self._server.port,
                         self._spec, agent_pid=os.getpid()),
            reports=self._reports,
            on_directive=on_directive,
            security=self._security,
        )

    def _reports(self) -> list[pb.RankReport]:
        if self._restarting_in and not self._newer():
            return [pb.RankReport(local_rank=0, pid=os.getpid(), state=pb.RANK_STATE_RESTARTING,
                                  generation=self._restarting_in)]
        return [pb.RankReport(local_rank=0, pid=os.getpid(), state=pb.RANK_STATE_UNMONITORED)]

    def _on_directive(self, d: pb.Directive) -> None:
        """On the link thread: the frames carry the newest generation at once."""
        if d.HasField("assignment"):
            self._link.session.generation = self._link.latest.generation

    # ---- RendezvousHandler -----------------------------------------------------------

    def get_backend(self) -> str:
        return "muster"

    @property
    def use_agent_store(self) -> bool:
        return False  # each round publishes its own MASTER_ADDR/PORT: no stale keys after a restart

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError()
        self._workers_ended = self._rounds > 0
        self._end_if_ending()
        if self._rounds and not self._newer():
            # Our own workers failed: ask for a new round with this node in its place.
            self._restarting_in = self._generation
            self._link.send_now()
            if not self._wait(self._newer, self._rejoin_after_s):
                self._join()  # not re-formed with its place: join as a new member
        self._rounds += 1
        if not self._wait(lambda: self._newer() and self._link.latest.role == pb.ROLE_ACTIVE, self._join_timeout_s):
            raise RendezvousTimeoutError(f"no place in job {self._job!r} within {self._join_timeout_s:.0f}s")
        a = self._link.latest
        self._generation = a.generation
        host, port = split_host_port(a.store_address)
        own = port == self._server.port and host in (self._host, "127.0.0.1")
        client = self._server if own else dist.TCPStore(host, port, is_master=False,
                                                        timeout=timedelta(seconds=self._join_timeout_s))
        store = dist.PrefixStore(a.store_prefix + "/", client)
        seal = Seal(a.store_key, a.store_prefix)
        addr_key, port_key = RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY
        if a.node_rank == 0:  # as RendezvousStoreInfo.build, but sealed, and a planted key is found, not overwritten
            publish(store, addr_key, self._host, seal)
            self._release_master_port()
            self._master_port = reserve_port(self._host)  # held until the next round: no stranger takes it
            publish(store, port_key, str(self._master_port.getsockname()[1]), seal)
        bootstrap = RendezvousStoreInfo(seal.open(addr_key, store.get(addr_key)).decode(),
                                        int(seal.open(port_key, store.get(port_key))))
        log.info("rdzv_round", job=self._job, generation=a.generation, node_rank=a.node_rank, nodes=a.num_nodes)
        return RendezvousInfo(store, a.node_rank, a.num_nodes, bootstrap)

    def _newer(self) -> bool:
        latest = self._link.latest
        return latest is not None and latest.generation > self._generation

    def _end_if_ending(self) -> None:
        """No round once the job is ending: one would run the finished script again. torchrun ends,
        by SystemExit with the outcome's status: torch's launcher stops the workers, calls shutdown()
        and lets it through (its @record returns for 0), so torchrun exits with that status. (Not
        RendezvousGracefulExitError, torch's own way out: in torch 2.13 run() returns None after it and
        launch_agent's `result.is_failed()` raises AttributeError: exit 1 with a traceback.)"""
        link = self._link
        end = link.ended
        if end is None and not (link.session is not None and link.session.finishing):
            return
        if end is not None:
            code, why = exit_code(end.outcome), f"run {end.run} of the job ended: {end.outcome}"
        elif self._workers_ended:
            # This node's workers failed (or were stopped) after a rank of the job finished: no new
            # round; the leader records the failure from the exit, and the node leaves as finishing.
            code, why = EXIT_FAILED, "this node's workers ended after a rank of the job finished its script"
            link.session.exits.append(pb.RankExit(local_rank=0, pid=os.getpid(), exit_code=EXIT_FAILED))
            link.send_now()
            deadline = time.monotonic() + EXIT_REPORT_WAIT_S  # in a frame before shutdown()'s Leave
            while link.session.exits and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            code, why = EXIT_SUCCEEDED, "the job is finishing: nothing to start here"
        log.info("rdzv_job_ending", job=self._job, code=code, reason=why)
        raise SystemExit(code)

    def _wait(self, predicate, timeout_s: float) -> bool:
        """Wait for `predicate`, at most timeout_s; ends torchrun if the job ends meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self._end_if_ending()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._link.changed.wait(min(remaining, 0.1))
            self._link.changed.clear()
        return True

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        """A newer generation than the workers run (a node joined or left): restart into it. Once the
        run ended, too: torchrun stops its workers and asks for a round, which ends torchrun. While
        the job is finishing, never: its workers finish their script."""
        if self._link.ended is not None:
            return 1
        if self._link.session is not None and self._link.session.finishing:
            return 0
        return 1 if self._newer() else 0

    def get_run_id(self) -> str:
        return self._run_id

    def _release_master_port(self) -> None:
        if self._master_port is not None:
            self._master_port.close()
            self._master_port = None

    def shutdown(self) -> bool:
        self._release_master_port()
        if self._link.ended is not None:  # no member of an ended run: nothing to leave
            self._link.close()
            return True
        try:
            self._link.leave(15, finished=True, reason="torchrun finished")
        except Exception as exc:
            log.warning("rdzv_shutdown_failed", error=str(exc))
            return False
        finally:
            self._link.close()
        return True


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's edge: the credentials come from the environment (MUSTER_TOKEN, MUSTER_TLS_*). A
    first Join that fails ends torchrun with one line instead of torch's traceback of the gRPC
    error, and the status `muster run` gives (docs/reference/exit-codes.md): 1 where no coordinator
    answered or one refused, 2 where the endpoint or a setting is wrong."""
    try:
        return MusterRendezvousHandler(params, ClientSecurity.from_env())
    except (grpc.RpcError, TimeoutError) as exc:
        said = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"torchrun --rdzv-backend=muster: job {params.run_id!r} could not join at {params.endpoint} "
              f"(--rdzv-endpoint) within {float(params.get('join_timeout', 600)):g}s (--rdzv-conf join_timeout): "
              f"{said}", file=sys.stderr)
        raise SystemExit(EXIT_FAILED) from None
    except ValueError as exc:  # a bad endpoint or setting
        print(f"torchrun --rdzv-backend=muster: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def handler_creator():
    """The `torchrun.handlers` entry point: torch calls it and registers what it returns."""
    return create_handler
