"""What a fault costs a job under Muster: N ranks of examples/train_ddp.py (worker library; gloo on
CPU, or --backend nccl with the ranks sharing the visible GPUs) against a real etcd and two
coordinator replicas, for each model size asked (--model: tiny, or 17M/134M/537M parameters of
square Linear layers with Adam, 12 bytes of state a parameter). Prints one JSON object.

  kill       SIGKILL one rank (repeatedly; a replacement joins in between):
             detection_s     kill -> the leader's decision (its log)
             kill_to_step_s  kill -> every survivor has completed a step in the new group
             steps_lost      completed steps the survivors redo (the new group's first step vs the
                             highest completed before); survivors_lost: survivors not in the new group;
                             survivors_stuck: those of them gloo's stuck wait ended (exit 3; an agent
                             would restart them), not counted in survivors_lost
             rejoin_s        replacement started -> its first step in the group (process start,
                             torch import, join, planned switch, state transfer)
             phases          where the survivors' reform went, p50/max over survivors and faults,
                             from their group_formed records: abort_s, destroy_s, before_form_s
                             (reform start -> its form: teardown, the wait for a place), store_s,
                             barrier_s (store included), init_s, sync_s (the state's agreement and any
                             transfer: fingerprint_s, agree_s, transfer_s, verify_s), form_s, seconds (the whole
                             reform), and first_collective_s (group formed -> its first step done,
                             one --step-sleep included); on NCCL, teardown_s and
                             teardown_abort_s: the aborted group's teardown in the background
                             (ncclCommAbort's join), off the path above
             state           bytes each survivor sent and received at the kill's reform (0 where the
                             survivors agree), and the replacement's: bytes received, its transfer's
                             seconds and rate (state_rate_mib_s)
             timeline        the same reform from outside the ranks, on this machine's one clock, seconds
                             from the signal (p50/max over faults): exited_s (the victim reaped: for a
                             kill, the kernel has freed its memory, which it does before its sockets
                             close), decided_s (the leader's decision, its log), formed_s (the last
                             survivor's group_formed record) and stepped_s (the last survivor's first
                             step in the new group); and between them: hear_s (reaped -> decided), reform_s (decided -> formed: the map's delivery, abort, destroy,
                             fingerprint, barrier: the phases above), first_step_s (formed -> stepped)
             healthy_evictions  eviction decisions naming a node other than the victim's
             late_arrivals   the ranks the arrival barrier waited for over 1 s (barrier_waiting),
                             with their group_formed phases and, where the training thread was
                             slow to notice the abort, where it was (abort_not_yet_seen)
  hang       SIGSTOP one rank: detection by the heartbeat timeout, then as above (hang_to_step_s)
  failover   SIGKILL the coordinator leader while training: time until the standby serves, steps
             discarded, evictions, generation changes (all should be 0)
  step_api   the training thread's cost of `with worker.step_scope():`
  steady_step_s   a step's time in steady training; kill.reform_cost_s: kill_to_step_s p50 less it
  raw_broadcast   one dist.broadcast of the state's bytes between the same number of processes,
                  measured after the run (bench/raw_broadcast.py): the rate a transfer is held against

    python bench/recovery.py --ranks 4,8,16 --kills 5
    python bench/recovery.py --ranks 4 --model tiny,17M --kills 3 --hangs 0 --failovers 0
    python bench/recovery.py --backend nccl --ranks 8 --kills 5 --hangs 3 --failovers 0
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from muster import logs
from muster.coordinator.core.kinds import EVICTIONS
from muster.coordinator.etcd.server import EtcdServer
from muster.local import CoordinatorProcess, TrainingProcess, end_on_sigterm, rank_env, record_time, wait_until
from muster.examples.train_ddp import MODELS, parameter_count
from muster.rank_logs import tail
from muster.worker import Worker, WorkerConfig
from muster.worker.library.stuck import STUCK_EXIT_CODE

sys.path.insert(0, str(Path(__file__).resolve().parent))
import raw_broadcast  # noqa: E402  (beside this file)

JOB = "bench"
HEARTBEAT_TIMEOUT_S = 2.0
# The group_formed fields timed by the worker (read where present: older workers log fewer).
PHASES = ("abort_s", "destroy_s", "before_form_s", "store_s", "barrier_s", "init_s", "fingerprint_s", "agree_s",
          "transfer_s", "verify_s", "sync_s", "form_s", "seconds")
# The example's --model sizes, by their parameter count; the state moved is 12 bytes a parameter with Adam
# (weights and two moments; grads are not moved).
PARAMETERS = {name: parameter_count(name) for name in MODELS}


# A fault in a group's first steps finds a rank inside DDP's bucket rebuild (a broadcast, then a
# blocking copy to the host): on one shared H200 NCCL's abort released it only after 1-7 s, and
# every survivor waited for it in the arrival barrier. Faults come in steady training here, after
# this many steps of the full group; --settled-steps 1 puts them in that window (docs/guide/nccl.md).
SETTLED_STEPS = 5
FORM_TIMEOUT_S = 300.0  # every rank started (a 537M model is built on the host first) and stepping together


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values), 4), "p99": round(percentile(values, 0.99), 4),
            "max": round(max(values), 4), "all": [round(v, 4) for v in values]}


def p50_max(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per named phase, its median and max (rounded as the JSON shows them)."""
    return {name: {"p50": round(statistics.median(v), 4), "max": round(max(v), 4)} for name, v in samples.items()}


def settled(steps: list[dict], world_size: int, n: int = SETTLED_STEPS) -> bool:
    """A rank's step records end in `n` steps of one generation of `world_size` ranks."""
    s = steps[-n:]
    return len(s) == n and s[-1]["world_size"] == world_size and all(r["generation"] == s[-1]["generation"] for r in s)


def step_api_cost_us(iterations: int = 200_000, batches: int = 9) -> dict:
    """The training thread's cost of `with worker.step_scope():` (no network on this thread)."""
    worker = Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="bench", node_id="bench"))
    scope = worker.step_scope()
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(iterations):
            pass
        empty = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(iterations):
            with scope:
                pass
        samples.append((time.perf_counter() - t0 - empty) / iterations * 1e6)
    return {"median_us": round(statistics.median(samples), 3), "max_us": round(max(samples), 3),
            "iterations": iterations * batches}


class Fleet:
    """etcd, two coordinator replicas and N library ranks (each its own node) of one job. Any number
    of ranks may train (min_nodes 1): a survivor lost at a fault (gloo's stuck wait, below) leaves
    the others training rather than waiting for a replacement the benchmark starts only later."""

    def __init__(self, workdir: Path, ranks: int, step_sleep_s: float, backend: str, env: dict[str, str],
                 model: str = "tiny", settled_steps: int = SETTLED_STEPS):
        self.workdir, self.ranks, self.step_sleep_s, self.backend = workdir, ranks, step_sleep_s, backend
        # A large model's fingerprint is not logged at every step (it reads all the state).
        self.args = ("--model", model, "--digest-every", "1" if model == "tiny" else "0")
        self.env = env  # the ranks' own additions (--env: NCCL settings or THP_MEM_ALLOC_ENABLE=1 under measure)
        self.settled_steps = settled_steps
        self.etcd = EtcdServer(workdir / "etcd").start()
        self.replicas = [CoordinatorProcess([self.etcd.endpoint], workdir / f"coordinator-{i}.log",
                                            ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]).start()
                         for i in range(2)]
        self.addresses = [r.address for r in self.replicas]
        self.procs: list[TrainingProcess] = []

    def launch(self, n: int) -> list[TrainingProcess]:
        new = [TrainingProcess(self.addresses, JOB, self.workdir / f"rank-{len(self.procs) + i}.log",
                               steps=10**9, step_sleep_s=self.step_sleep_s, min_nodes=1,
                               max_nodes=self.ranks, env={**rank_env(self.backend), **self.env},
                               args=self.args).start()
               for i in range(n)]
        self.procs.extend(new)
        return new

    def alive(self) -> list[TrainingProcess]:
        return [p for p in self.procs if p.proc.poll() is None]

    def full(self, timeout_s: float = FORM_TIMEOUT_S, steps: int = 0) -> None:
        """Every rank has taken `steps` (default: settled_steps) steps in a group of all of them: with
        SETTLED_STEPS, the next fault lands in steady training, not in a new group's first steps (DDP's
        bucket rebuild)."""
        steps = steps or self.settled_steps
        wait_until(lambda: len(self.alive()) == self.ranks
                   and all(settled(p.steps(), self.ranks, steps) for p in self.alive()),
                   timeout_s, "all ranks stepping together", interval_s=0.1)

    def generation(self) -> int:
        return max(p.steps()[-1]["generation"] for p in self.alive() if p.steps())

    def decisions(self, since: float, kinds: set[str]) -> list[float]:
        return [record_time(r) for r in self.changes(since, kinds)]

    def changes(self, since: float, kinds: set[str]) -> list[dict]:
        return [r for rep in self.replicas for r in rep.find("membership_changed")
                if r["kind"] in kinds and record_time(r) >= since]

    def leader(self) -> CoordinatorProcess:
        """The replica leading the job, waited for: on a loaded host a leader's etcd session can lapse
        and the job be led again a moment later (a Status in between finds no live leader)."""
        return wait_until(lambda: next((r for r in self.replicas if r.leads(JOB)), None), 30, "a replica leading")

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        for r in self.replicas:
            r.stop()
        self.etcd.stop()


def fault_cycles(fleet: Fleet, faults: int, how: str) -> dict:
    """SIGKILL (how="kill") or SIGSTOP ("hang") one rank at a time; time the answer; refill."""
    sig, kinds = {"kill": (signal.SIGKILL, {"process_exited"}),
                  "hang": (signal.SIGSTOP, {"node_silent", "rank_stalled"})}[how]
    recoveries, detections, lost, rejoins, late = [], [], [], [], []
    phases: dict[str, list[float]] = {}
    timeline: dict[str, list[float]] = {}
    state: dict[str, list[float]] = {}
    survivors_lost = survivors_stuck = healthy_evictions = 0
    for _ in range(faults):
        live = fleet.alive()
        victim = random.choice(live)
        survivors = [p for p in live if p is not victim]
        generation = fleet.generation()
        completed_before = max(p.last_step for p in live)
        reaped: list[float] = []
        waiter = threading.Thread(target=lambda: (victim.proc.wait(), reaped.append(time.time())), daemon=True)
        at = time.time()
        victim.signal(sig)
        if how == "kill":
            waiter.start()

        def first_new_steps():
            firsts = []
            for p in survivors:
                new = [r for r in p.steps() if r["generation"] > generation]
                if new:
                    firsts.append((p, new[0]))
                elif p.proc.poll() is None:
                    return None  # still reforming
            return firsts

        stepped = wait_until(first_new_steps, 60, "survivors stepping in the new group",
                             diagnose=lambda: stalled(fleet, survivors, generation))
        firsts = [r for _, r in stepped]
        for p, first in stepped:
            for name, value in reform_phases(p, first).items():
                phases.setdefault(name, []).append(value)
            for name, value in moved(p, first["generation"], "survivor").items():
                state.setdefault(name, []).append(value)
        late.extend(late_arrivals(stepped))
        # A survivor whose training thread gloo left in a wait no closed connection ends (the victim
        # died with a message to it half read) exits STUCK_EXIT_CODE within seconds: under an agent
        # it is restarted (docs/limits.md). Counted apart from the survivors lost otherwise.
        ended = [p.proc.poll() for p in survivors if p.proc.poll() is not None]
        survivors_stuck += ended.count(STUCK_EXIT_CODE)
        survivors_lost += len(ended) - ended.count(STUCK_EXIT_CODE)
        recoveries.append(max(record_time(r) for r in firsts) - at)
        decided = fleet.decisions(at, kinds)
        if how == "kill" and decided and firsts:
            waiter.join(10)
            for name, value in outside_timeline(at, reaped[0] if reaped else None, min(decided), stepped).items():
                timeline.setdefault(name, []).append(value)
        lost.append(max(0, completed_before - min(r["step"] for r in firsts) + 1))
        detections += [min(fleet.decisions(at, kinds)) - at] if fleet.decisions(at, kinds) else []
        victim.stop()  # a hung one is fenced out when it wakes; end it now
        started = time.time()
        joiner, *_ = fleet.launch(fleet.ranks - len(fleet.alive()))
        fleet.full()
        for name, value in teardowns(survivors, generation).items():  # done in the background by now
            phases.setdefault(name, []).append(value)
        rejoins.append(record_time(joiner.steps()[0]) - started)
        for name, value in moved(joiner, joiner.steps()[0]["generation"], "replacement").items():
            state.setdefault(name, []).append(value)
        victim_node = victim.records("node_joined")[0]["node"]
        healthy_evictions += sum(len(set(r["nodes"]) - {victim_node}) for r in fleet.changes(at, EVICTIONS))
    return {"detection_s": summary(detections), f"{how}_to_step_s": summary(recoveries),
            "steps_lost": {"max": max(lost), "total": sum(lost)}, "survivors_lost": survivors_lost,
            "survivors_stuck": survivors_stuck,
            "healthy_evictions": healthy_evictions, "rejoin_s": summary(rejoins),
            "phases": p50_max(phases), "timeline": p50_max(timeline), "state": p50_max(state),
            "late_arrivals": late}


def outside_timeline(at: float, reaped: float | None, decided: float,
                     stepped: list[tuple[TrainingProcess, dict]]) -> dict[str, float]:
    """A kill's reform on one clock from the signal `at`: the victim reaped, the leader's decision,
    the last survivor's group formed and its first step; and the spans between them."""
    generation = stepped[0][1]["generation"]
    formed = max((record_time(r) for p, _ in stepped for r in p.records("group_formed")
                  if r["generation"] == generation), default=None)
    last_step = max(record_time(r) for _, r in stepped)
    out = {"decided_s": decided - at, "stepped_s": last_step - at}
    if reaped is not None:
        out.update(exited_s=reaped - at, hear_s=decided - reaped)
    if formed is not None:
        out.update(formed_s=formed - at, reform_s=formed - decided, first_step_s=last_step - formed)
    return {k: round(v, 4) for k, v in out.items()}


def stalled(fleet: Fleet, survivors: list[TrainingProcess], generation: int) -> str:
    """Where the survivors that made no step after `generation` are, and what the replicas decided
    (a wait that timed out names its cause instead of only its bound)."""
    lines = [f"{p.log_path}: {[line[:300] for line in tail(p.log_path, 15)[0]]}"
             for p in survivors if p.proc.poll() is None and not any(r["generation"] > generation for r in p.steps())]
    decided = [{k: r.get(k) for k in ("timestamp", "kind", "generation", "nodes", "reason")}
               for r in fleet.changes(0, {"process_exited", "node_silent", "rank_stalled", "node_joined", "group_broken"})]
    return "\n".join([f"stalled survivors (generation {generation}):", *lines, f"decisions: {decided[-10:]}"])


def late_arrivals(stepped: list[tuple[TrainingProcess, dict]]) -> list[dict]:
    """The ranks that the new generation's arrival barrier waited for past the worker's
    BARRIER_LATE_S (its barrier_waiting records), with their own reform's phases."""
    generation = stepped[0][1]["generation"] if stepped else 0
    missing = {r for p, _ in stepped for w in p.records("barrier_waiting") if w["generation"] == generation
               for r in w["missing"]}
    return [{"generation": generation, "rank": f["rank"], **{k: f[k] for k in PHASES if k in f},
             "training_thread_at": [r["training_thread_at"] for r in p.records("abort_not_yet_seen")
                                    if r["aborted_by"] == generation][-1:]}
            for p, first in stepped for f in p.records("group_formed")
            if f["generation"] == generation and f["rank"] in missing]


def teardowns(survivors: list[TrainingProcess], generation: int) -> dict[str, float]:
    """The slowest survivor's background teardown of `generation`'s aborted group (group_torn_down,
    NCCL and its twin): submitted -> dropped, and its abort call (ncclCommAbort) alone."""
    done = [r for p in survivors for r in p.records("group_torn_down") if r["generation"] == generation]
    if not done:
        return {}
    return {"teardown_s": max(r["seconds"] for r in done), "teardown_abort_s": max(r["abort_s"] for r in done)}


def moved(p: TrainingProcess, generation: int, who: str) -> dict[str, float]:
    """The state a rank moved forming `generation` (its group_formed record), named for `who`."""
    formed = [r for r in p.records("group_formed") if r["generation"] == generation]
    if not formed or "bytes_sent" not in formed[-1]:
        return {}
    f = formed[-1]
    out = {f"{who}_sent_bytes": f["bytes_sent"], f"{who}_received_bytes": f["bytes_received"]}
    if who == "replacement" and f["bytes_received"] and f.get("transfer_s"):
        out["replacement_transfer_s"] = f["transfer_s"]
        out["state_rate_mib_s"] = f["bytes_received"] / f["transfer_s"] / (1 << 20)
    return out


def steady_step_s(fleet: Fleet) -> float:
    """The median time between the last steps of the ranks, in steady training."""
    gaps = []
    for p in fleet.alive():
        times = [record_time(r) for r in p.steps()[-SETTLED_STEPS:]]
        gaps += [b - a for a, b in zip(times, times[1:])]
    return round(statistics.median(gaps), 4) if gaps else 0.0


def reform_phases(p: TrainingProcess, first: dict) -> dict[str, float]:
    """Where a survivor's reform into the generation of its step record `first` went."""
    formed = [r for r in p.records("group_formed") if r["generation"] == first["generation"]]
    if not formed:
        return {}
    out = {name: formed[-1][name] for name in PHASES if name in formed[-1]}
    out["first_collective_s"] = record_time(first) - record_time(formed[-1])
    return out


def failover_cycles(fleet: Fleet, kills: int) -> dict:
    """SIGKILL the coordinator leader (restarted at once as the next standby); training must not notice."""
    served, discarded, evictions, generation_changes = [], 0, 0, 0
    for _ in range(kills):
        leader = fleet.leader()
        standby = next(r for r in fleet.replicas if r is not leader and r.proc.poll() is None)
        generation = fleet.generation()
        steps = {id(p): p.last_step for p in fleet.alive()}
        at = time.time()
        leader.kill()
        wait_until(lambda: standby.leads(JOB), 30, "the standby leading", interval_s=0.01)
        served.append(time.time() - at)
        wait_until(lambda: all(p.last_step >= steps[id(p)] + 20 for p in fleet.alive()), 60, "training on")
        discarded += sum(1 for p in fleet.alive() for r in p.records("step_discarded") if record_time(r) >= at)
        evictions += len(fleet.decisions(at, EVICTIONS))
        generation_changes += fleet.generation() != generation
        # the dead replica comes back at its address, as a standby
        i = fleet.replicas.index(leader)
        fleet.replicas[i] = CoordinatorProcess([fleet.etcd.endpoint], fleet.workdir / f"coordinator-{i}-{len(served)}.log",
                                               ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)],
                                               listen=leader.address).start()
    return {"kills": kills, "standby_serves_s": summary(served), "steps_discarded": discarded,
            "evictions": evictions, "generation_changes": generation_changes}


def run(workdir: Path, ranks: int, kills: int, hangs: int, failovers: int, step_sleep_s: float,
        backend: str, env: dict[str, str], model: str = "tiny", settled_steps: int = SETTLED_STEPS) -> dict:
    fleet = Fleet(workdir, ranks, step_sleep_s, backend, env, model, settled_steps)
    try:
        fleet.launch(ranks)
        fleet.full(FORM_TIMEOUT_S, SETTLED_STEPS)  # steady, to measure it: the first fault lands there too
        steady = steady_step_s(fleet)
        out = {"ranks": ranks, "model": model, "parameters": PARAMETERS[model], "steady_step_s": steady,
               "kill": fault_cycles(fleet, kills, "kill")}
        out["kill"]["reform_cost_s"] = round(out["kill"]["kill_to_step_s"]["p50"] - steady, 4)
        if hangs:
            out["hang"] = fault_cycles(fleet, hangs, "hang")
        if failovers:
            out["failover"] = failover_cycles(fleet, failovers)
    finally:
        fleet.stop()
    if model != "tiny":  # the link's own rate for the same bytes, measured with the fleet gone
        out["raw_broadcast"] = raw_broadcast.measure(ranks, PARAMETERS[model] * 12,
                                                     "nccl" if backend == "nccl" else "gloo")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="8", help="rank counts, comma-separated (default 8)")
    p.add_argument("--backend", choices=("gloo", "nccl", "nccl-twin"), default="gloo",
                   help="the ranks' MUSTER_BACKEND (nccl: the ranks share the visible GPUs)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every rank's environment (repeatable; e.g. NCCL_RUNTIME_CONNECT=0)")
    p.add_argument("--settled-steps", type=int, default=SETTLED_STEPS,
                   help=f"steps of the full group before each fault (default {SETTLED_STEPS}: steady training; "
                        "1: the fault lands in a new group's first steps, DDP's bucket rebuild)")
    p.add_argument("--model", default="tiny,17M",
                   help=f"model sizes, comma-separated: {', '.join(PARAMETERS)} (default tiny,17M)")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--hangs", type=int, default=2)
    p.add_argument("--failovers", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = p.parse_args()
    unknown = set(args.model.split(",")) - set(PARAMETERS)
    if unknown:
        p.error(f"--model: unknown {', '.join(sorted(unknown))} ({', '.join(PARAMETERS)})")
    bad = [e for e in args.env if "=" not in e]
    if bad:
        p.error(f"--env: NAME=VALUE, not {', '.join(bad)}")
    env = dict(e.split("=", 1) for e in args.env)
    logs.configure("warning")
    result = {"benchmark": "recovery", "backend": args.backend, "env": env, "settled_steps": args.settled_steps,
              "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
              "step_sleep_s": args.step_sleep, "step_api": step_api_cost_us(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="muster-bench-") as d:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for model in args.model.split(","):
                workdir = (args.workdir or Path(d)) / f"ranks-{ranks}-{model}"
                workdir.mkdir(parents=True, exist_ok=True)
                # A model of real size steps at its own pace: no simulated compute on top.
                step_sleep = args.step_sleep if model == "tiny" else 0.0
                result["runs"].append(run(workdir, ranks, args.kills, args.hangs, args.failovers, step_sleep,
                                          args.backend, env, model, args.settled_steps))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
