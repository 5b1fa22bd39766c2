"""Relays with real coordinator processes on a real etcd: the nodes of a large job stream through
the replica their node_id hashes to, which carries them to the leader on one Relay stream."""

import asyncio
import signal
import time

import grpc
import pytest

from muster.client import Coordinators, relay_of
from muster.local import SimulatedNode, wait_until
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

RELAY = ["--relay-min-nodes", "4", "--relay-batch", "0.02"]
# The default heartbeat timeout (2 s), not the tier's 1 s, where a test's six simulated nodes must all be
# heard: they share one event loop, and on a loaded host healthy ones went unheard past 1 s (fresh-clone
# run S: one attached to a successor 1.03 s after the first; another run: two evicted before a stall).
SHARED_LOOP = ["--heartbeat-timeout", "2.0"]
EVICTIONS = {"node_silent", "rank_silent", "rank_stalled", "process_exited", "node_left", "rank_exited"}


def names_spread(addresses: list[str], per_replica: int) -> list[str]:
    """Node ids such that each replica is the relay of `per_replica` of them."""
    names, count = [], dict.fromkeys(addresses, 0)
    i = 0
    while min(count.values()) < per_replica:
        name = f"node-{i:03d}"
        pick = relay_of(name, addresses)
        if count[pick] < per_replica:
            count[pick] += 1
            names.append(name)
        i += 1
    return names


async def stepping_job(addresses, job, names, *, slots=1, is_process=False, node=SimulatedNode):
    n = len(names)
    nodes = [node(addresses, job, name, slots=slots, spec=pb.JobSpec(min_nodes=n, max_nodes=n),
                  is_process=is_process) for name in names]
    for node in nodes:
        await node.join()
        node.start()
    for node in nodes:
        await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "first map")
    return nodes


def leader_of(replicas, job):
    for r in replicas:
        if r.leads(job):
            return r
    return None


def evictions(address: str, job: str) -> list:
    with Coordinators([address], timeout_s=2) as c:
        events = c.call("Events", pb.EventsRequest(job=job)).events
    return [e for e in events if e.kind in EVICTIONS]


async def steps_advance(nodes, steps: int = 5) -> None:
    """Every node steps `steps` more (one a frame, 20 a second)."""
    before = {n.node_id: n.step for n in nodes}
    for node in nodes:
        await node.wait_for(lambda x: x.step >= before[x.node_id] + steps, 5, f"{steps} more steps")


async def train_on_unchanged(nodes, generation: int, leader_address: str, job: str) -> None:
    """Every node steps on in `generation`, without an error, and the leader evicted nobody."""
    await steps_advance(nodes)
    assert all(n.generation == generation and not n.errors for n in nodes)
    assert not evictions(leader_address, job)


async def new_leader_reached(survivors, job: str, nodes):
    """The replica among `survivors` that leads `job` once its term reached every node."""
    new = await asyncio.to_thread(wait_until, lambda: leader_of(survivors, job), 10, "a new leader")
    with Coordinators([new.address], timeout_s=2) as c:
        term = c.call("Status", pb.StatusRequest(job=job, brief=True)).jobs[0].term
    try:
        for n in nodes:
            await n.wait_for(lambda x: x.term == term, 8, "the new leader's term")
    except AssertionError as exc:  # (seen once in CI: what each replica said of the job, to tell why)
        raise AssertionError(f"{exc}\nnew leader {new.address}, term {term}; {said(survivors, job)}") from None
    return new


def said(replicas, job: str) -> str:
    """What each replica said of `job` last, to tell why a wait on them failed."""
    lines = {r.address: [{k: v for k, v in e.items() if k not in ("job", "level")} for e in r.records()
                         if e.get("job") == job][-40:] for r in replicas}
    return "the replicas' lines:\n" + "\n".join(f"{a}: {line}" for a, ls in lines.items() for line in ls)


async def pulses_heard(nodes, pulses: int) -> None:
    """Every node hears `pulses` more of the leader's pulses (one each heartbeat timeout / 4 of the
    leader's clock, through its relay or not): that much of the leader's time went by since, and a
    generation decided meanwhile reached every node (a pulse carries it)."""
    before = {n.node_id: n.session.pulses for n in nodes}
    for node in nodes:
        await node.wait_for(lambda x: x.session.pulses >= before[x.node_id] + pulses, 10, f"{pulses} more pulses")


async def leader_heard_progress(address: str, job: str, node_ids: list[str], times: int) -> None:
    """The leader saw each of `node_ids`' steps advance `times` times (a relay summarises its nodes'
    progress once per --relay-progress: their steps are at least its summary's lowest)."""
    seen: dict[str, set[int]] = {n: set() for n in node_ids}
    deadline = time.monotonic() + 15
    with Coordinators([address], timeout_s=2) as c:
        while min(len(s) for s in seen.values()) <= times:
            assert time.monotonic() < deadline, f"the leader's view of relayed progress: {seen}"
            for r in (await asyncio.to_thread(c.call, "Status", pb.StatusRequest(job=job))).jobs[0].ranks:
                if r.node in seen:
                    seen[r.node].add(r.step)
            await asyncio.sleep(0.1)


async def exit_decided_s(nodes, exiting, local_rank: int) -> float:
    """A rank of `exiting` exits: seconds until another node holds the abort generation."""
    # every node on one generation first: a node still behind would count the last change as this one's
    generation = max(n.generation for n in nodes)
    for n in nodes:
        await n.wait_for(lambda x: x.generation == generation, 2, f"generation {generation} everywhere")
    exiting.exits.append(pb.RankExit(local_rank=local_rank, pid=10_000 + local_rank, exit_code=-9))
    exiting.session.send_now()
    reported = time.monotonic()
    other = next(n for n in nodes if n is not exiting)
    await other.wait_for(lambda x: x.generation > generation, 2, "the abort generation")
    assert other.assignment().abort_previous
    return time.monotonic() - reported


@pytest.mark.timeout(90)
def test_nodes_spread_over_the_standbys_step_and_a_relayed_exit_is_decided_at_once(coordinators):
    replicas = coordinators(3, RELAY)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "spread", names_spread(addresses, 2), slots=2)
        leader = leader_of(replicas, "spread")
        # over the replicas but the leader, which reads what relays forward, not node frames
        standbys = [a for a in addresses if a != leader.address]
        assert all(n.session.relay == relay_of(n.node_id, standbys) for n in nodes)
        # every standby relays its share: the leader holds one Relay stream per standby
        relays = {r["relay"] for r in leader.find("relay_attached", job="spread")}
        assert relays == set(addresses) - {leader.address}
        with Coordinators([leader.address], timeout_s=2) as c:
            status = c.call("Status", pb.StatusRequest(job="spread")).jobs[0]
        assert status.health.live_ranks == 12
        pulses = {n.node_id: n.session.pulses for n in nodes}
        await steps_advance(nodes)
        # the leader pulses each relay once (every heartbeat timeout / 4 = 0.25 s), which pulses its nodes
        for n in nodes:
            await n.wait_for(lambda x: x.session.pulses >= pulses[x.node_id] + 2, 3, "two pulses through its relay")
        # a rank's exit on a relayed node is flushed at once and decided in the next tally, as on a
        # node streaming to the leader itself (< 0.5 s: a batch window and a tally); on each relay
        first = next(n for n in nodes if n.session.relay == standbys[0])
        second = next(n for n in nodes if n.session.relay == standbys[1])
        decided_s = [await exit_decided_s(nodes, first, 1), await exit_decided_s(nodes, second, 1)]
        assert max(decided_s) < 0.5, decided_s
        with Coordinators([leader.address], timeout_s=2) as c:
            events = c.call("Events", pb.EventsRequest(job="spread")).events
        exits = [e for e in events if e.kind == "rank_exited"]
        assert [list(e.nodes) for e in exits] == [[first.node_id], [second.node_id]]
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_relay_forwards_only_changes_and_judges_silence_itself(coordinators):
    replicas = coordinators(3, RELAY)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "quiet", names_spread(addresses, 3))
        leader = leader_of(replicas, "quiet")
        relayed = [n for n in nodes if n.session.relay != leader.address]
        # steady: every node steps at each of its 20 frames a second, and the leader has seen the
        # relayed ones' progress forwarded three times (the smoothed rate has settled meanwhile)
        await leader_heard_progress(leader.address, "quiet", [n.node_id for n in relayed], 3)
        with Coordinators([leader.address], timeout_s=2) as c:
            health = c.call("Status", pb.StatusRequest(job="quiet")).jobs[0].health
        # The leader reads its 3 direct nodes' frames (60/s) and the relayed ones' progress about
        # once a second each (--relay-progress 1), not their 120 frames/s.
        assert health.frames_per_second < 60 + 3 * len(relayed), health
        victim = relayed[0]
        generation = victim.generation
        victim.silent = True  # its stream stays open: only the relay can tell it went silent
        paused = time.monotonic()
        other = next(n for n in nodes if n is not victim)
        await other.wait_for(lambda x: x.generation > generation, 5, "the generation without it")
        assert time.monotonic() - paused < 1.0 + 0.6  # the heartbeat timeout, a relay sweep, a tally
        with Coordinators([leader.address], timeout_s=2) as c:
            events = c.call("Events", pb.EventsRequest(job="quiet")).events
        assert [list(e.nodes) for e in events if e.kind == "node_silent"] == [[victim.node_id]]
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


class StuckNode(SimulatedNode):
    """A node whose ranks stop advancing once `stuck` (a hung collective): its frames go on."""

    stuck = False

    def _reports(self) -> list[pb.RankReport]:
        self.step -= self.stuck
        return super()._reports()


@pytest.mark.timeout(90)
def test_a_relayed_rank_that_stops_advancing_is_named_lagging_and_judged_stalled(coordinators):
    replicas = coordinators(3, [*RELAY, "--progress-timeout", "2", *SHARED_LOOP])
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "hung", names_spread(addresses, 2), node=StuckNode)
        leader = leader_of(replicas, "hung")
        # Steady: the relays summarise their nodes' progress, no frame of theirs goes up.
        await leader_heard_progress(leader.address, "hung", [n.node_id for n in nodes], 3)
        victim = next(n for n in nodes if n.session.relay != leader.address)
        generation = victim.generation
        victim.stuck = True
        stuck_at = time.monotonic()
        other = next(n for n in nodes if n is not victim)
        await other.wait_for(lambda x: x.generation > generation, 10, "the generation without it")
        # The progress timeout, a relay interval (--relay-progress 1) to name it lagging, a tally.
        assert time.monotonic() - stuck_at < 2 + 1 + 0.6
        with Coordinators([leader.address], timeout_s=2) as c:
            events = c.call("Events", pb.EventsRequest(job="hung")).events
        assert [list(e.nodes) for e in events if e.kind in EVICTIONS] == [[victim.node_id]], events
        assert [e.kind for e in events if e.kind in EVICTIONS] == ["rank_stalled"]
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_relayed_process_node_that_hangs_up_is_lost_at_once(coordinators):
    replicas = coordinators(2, RELAY)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "procs", names_spread(addresses, 2), is_process=True)
        leader = leader_of(replicas, "procs")
        relayed = next(n for n in nodes if n.session.relay != leader.address)
        generation = relayed.generation
        await relayed.stop()  # its stream to the relay ends: for a process node, its exit
        stopped = time.monotonic()
        other = next(n for n in nodes if n is not relayed)
        await other.wait_for(lambda x: x.generation > generation, 2, "the generation without it")
        assert time.monotonic() - stopped < 0.5
        with Coordinators([leader.address], timeout_s=2) as c:
            events = c.call("Events", pb.EventsRequest(job="procs")).events
        assert [list(e.nodes) for e in events if e.kind == "process_exited"] == [[relayed.node_id]]
        for n in nodes:
            if n is not relayed:
                await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_small_job_and_a_replica_run_with_no_relay_stream_to_the_leader(coordinators):
    replicas = coordinators(2, RELAY) + coordinators(1, [*RELAY, "--no-relay"])
    addresses = [r.address for r in replicas]

    async def scenario():
        small = await stepping_job(addresses, "small", ["a", "b"])
        assert all(n.session.relay == "" for n in small)
        nodes = await stepping_job(addresses, "big", names_spread(addresses, 2))
        leader = leader_of(replicas, "big")
        assert {r["relay"] for r in leader.find("relay_attached", job="big")} <= {replicas[0].address,
                                                                                  replicas[1].address}
        assert not replicas[2].find("relay_accepted")
        await steps_advance(nodes)
        for n in small + nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_killed_relay_moves_its_nodes_and_nobody_is_evicted(coordinators):
    replicas = coordinators(3, RELAY)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "relaykill", names_spread(addresses, 2))
        leader = leader_of(replicas, "relaykill")
        victim = next(r for r in replicas if r is not leader)
        moved = [n for n in nodes if n.session.relay == victim.address]
        generation = nodes[0].generation
        victim.kill()
        # six pulses (1.5 s of the leader's clock, past the heartbeat timeout of 1 s) heard by every
        # node, the moved ones on their new streams: nothing decided meanwhile
        await pulses_heard(nodes, 6)
        await train_on_unchanged(nodes, generation, leader.address, "relaykill")
        assert all(n.session.leader != victim.address for n in moved)
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_frozen_relay_is_left_by_its_nodes_before_anyone_is_evicted(coordinators):
    replicas = coordinators(3, RELAY)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "relaystop", names_spread(addresses, 2))
        leader = leader_of(replicas, "relaystop")
        victim = next(r for r in replicas if r is not leader)
        generation = nodes[0].generation
        victim.signal(signal.SIGSTOP)  # its streams stay open and carry nothing
        try:
            await asyncio.to_thread(wait_until, lambda: leader.find("relay_silent", job="relaystop",
                                                                    relay=victim.address), 10, "the relay found silent")
            # and six pulses (1.5 s of the leader's clock) heard by every node, those of the frozen
            # relay once they left it: past the heartbeat timeout (1 s) and then some, nothing decided
            await pulses_heard(nodes, 6)
            await train_on_unchanged(nodes, generation, leader.address, "relaystop")
        finally:
            victim.signal(signal.SIGCONT)
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_relays_follow_a_new_leader_after_the_leader_is_killed(coordinators):
    replicas = coordinators(3, RELAY)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "leaderkill", names_spread(addresses, 2))
        old = leader_of(replicas, "leaderkill")
        generation = nodes[0].generation
        old.kill()
        survivors = [r for r in replicas if r is not old]
        new = await new_leader_reached(survivors, "leaderkill", nodes)
        standby = next(r for r in survivors if r is not new)
        # the surviving standby relays its nodes to the new leader
        await asyncio.to_thread(wait_until, lambda: new.find("relay_attached", job="leaderkill", relay=standby.address),
                                8, "the standby relaying to the new leader",
                                diagnose=lambda: said(survivors, "leaderkill"))
        await train_on_unchanged(nodes, generation, new.address, "leaderkill")
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_relays_leave_a_frozen_leader_for_its_successor_and_nobody_is_evicted(coordinators):
    """A frozen leader keeps its relays' calls open (its socket takes writes) and the relays answer
    their nodes: each relay must notice the silence, ask etcd, and move its nodes on once a standby
    is elected, all in time for the successor's takeover grace (2 s), counted from the first frame."""
    replicas = coordinators(3, [*RELAY, *SHARED_LOOP])  # (after the first frame, one timeout for the others)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "leaderstop", names_spread(addresses, 2))
        old = leader_of(replicas, "leaderstop")
        generation = nodes[0].generation
        old.signal(signal.SIGSTOP)
        try:
            survivors = [r for r in replicas if r is not old]
            new = await new_leader_reached(survivors, "leaderstop", nodes)
            # each survivor's relay left the frozen leader on etcd's word, not on a timeout of its nodes'
            for r in survivors:
                moved = r.find("relay_leader_moved", job="leaderstop")
                assert moved and moved[0]["silent"] == old.address and moved[0]["elected"] == new.address, moved
            await pulses_heard(nodes, 6)  # 3 s of the new leader's clock: its grace over, and a heartbeat timeout
            await train_on_unchanged(nodes, generation, new.address, "leaderstop")
        finally:
            old.signal(signal.SIGCONT)
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_forged_relay_stream_cannot_attach_or_end_a_node(coordinators):
    replicas = coordinators(2, RELAY)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "forged", names_spread(addresses, 2))
        leader = leader_of(replicas, "forged")
        standby = next(r for r in replicas if r is not leader)
        victim = nodes[0]
        generation = victim.generation
        forged = pb.NodeFrame(job="forged", node_id=victim.node_id, member_id=victim.member_id, term=victim.term,
                              generation=generation, session_secret=b"x" * 32)
        async with grpc.aio.insecure_channel(leader.address) as channel:
            call = pb_grpc.CoordinatorStub(channel).Relay()
            await call.write(pb.RelayUp(job="forged", relay="evil", ended=[1, 2, 3]))
            assert not (await asyncio.wait_for(call.read(), 5)).items  # accepted: anyone with the job's token may
            await call.write(pb.RelayUp(job="forged", relay="evil", ended=[1, 2, 3],
                                        frames=[pb.RelayedFrame(stream=7, frame=forged)]))
            down = await asyncio.wait_for(call.read(), 5)
            (item,) = down.items
            assert item.stream == 7 and item.end.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
            # a frame of that refused stream does not open it again, nor does a lower number
            await call.write(pb.RelayUp(job="forged", relay="evil", frames=[
                pb.RelayedFrame(stream=7, frame=forged), pb.RelayedFrame(stream=3, frame=forged)]))
            await call.write(pb.RelayUp(job="other", relay="evil"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(call.read(), 5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a standby takes no Relay stream: it names the leader
        async with grpc.aio.insecure_channel(standby.address) as channel:
            call = pb_grpc.CoordinatorStub(channel).Relay()
            await call.write(pb.RelayUp(job="forged", relay="evil"))
            with pytest.raises(grpc.aio.AioRpcError) as not_leader:
                await asyncio.wait_for(call.read(), 5)
            assert not_leader.value.code() == grpc.StatusCode.UNAVAILABLE
            assert dict(not_leader.value.trailing_metadata())["muster-leader"] == leader.address
        # the forged messages were read before the refusal that ended the call: two pulses more (a
        # pulse period and more, many tallies) would carry any generation they made to every node
        await pulses_heard(nodes, 2)
        await train_on_unchanged(nodes, generation, leader.address, "forged")
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


async def decisions_for_faults(addresses: list[str], job: str) -> tuple[list[tuple], bool]:
    """Four nodes x 2 ranks; then, one after another, a rank's exit, a node gone silent and a node
    leaving. Returns what the leader decided for them (kind, nodes, world size of each event),
    and whether the nodes streamed through relays."""
    names = ["n0", "n1", "n2", "n3"]
    nodes = [SimulatedNode(addresses, job, name, slots=2, spec=pb.JobSpec(min_nodes=2, max_nodes=4))
             for name in names]
    for node in nodes:
        await node.join()
        node.start()
    for node in nodes:
        await node.wait_for(lambda x: x.assignment().world_size == 8, 10, "every node in the map")
    with Coordinators(addresses, timeout_s=2) as c:
        before = len(c.call("Events", pb.EventsRequest(job=job)).events)
    exiting, watching, silent, leaving = nodes

    async def next_generation(what: str) -> None:
        await watching.wait_for(lambda x: x.generation > generation, 10, what)

    generation = watching.generation
    exiting.exits.append(pb.RankExit(local_rank=1, pid=10_001, exit_code=-9))
    exiting.session.send_now()
    await next_generation("the abort generation for the exit")
    generation = watching.generation
    silent.silent = True
    await next_generation("the generation without the silent node")
    generation = watching.generation
    await leaving.session.leave(reason="scaling down")
    await next_generation("the generation without the node that left")
    relayed = all(n.session.relay for n in (exiting, watching))
    with Coordinators(addresses, timeout_s=2) as c:
        events = c.call("Events", pb.EventsRequest(job=job)).events[before:]
    for n in nodes:
        await n.stop()
    return [(e.kind, tuple(e.nodes), e.world_size) for e in events], relayed


@pytest.mark.timeout(120)
def test_the_relay_path_and_the_direct_path_decide_the_same_for_the_same_faults(coordinators):
    direct_replicas = coordinators(2)  # a 4-node job is far below the default --relay-min-nodes
    direct, relayed = asyncio.run(decisions_for_faults([r.address for r in direct_replicas], "direct"))
    assert not relayed
    for r in direct_replicas:
        r.stop()
    relay_replicas = coordinators(3, ["--relay-min-nodes", "1", "--relay-batch", "0.02"])  # every node relayed
    through_relays, relayed = asyncio.run(decisions_for_faults([r.address for r in relay_replicas], "relayed"))
    assert relayed
    assert [kind for kind, _, _ in direct] == ["rank_exited", "generation", "node_silent", "generation",
                                               "node_left", "generation"], direct
    assert through_relays == direct, (through_relays, direct)
