"""Warm starts: ranks forked from a real zygote process see what `python SCRIPT` would show them,
report their exit status, and die with the zygote."""

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from muster.local import WarmRanks, process_alive, wait_until
from muster.worker.rank import orphan_guard
from muster.worker.rank.runner import COMPLETED_FILE_ENV, Program
from muster.worker.rank.zygote import WarmStarts, Zygote, ZygoteLost

GUARD = orphan_guard.prefix()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def script(tmp_path, body: str):
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(body))
    return path


async def _spawn(zygote, program, tmp_path, env=None, name="out"):
    out = open(tmp_path / f"{name}.txt", "wb")
    err = open(tmp_path / f"{name}.err", "wb")
    try:
        return await zygote.spawn(program, {"PATH": os.environ["PATH"], **(env or {})},
                                  (0, out.fileno(), err.fileno()))
    finally:
        out.close()
        err.close()


@pytest.mark.timeout(60)
def test_a_forked_rank_sees_its_own_argv_env_cwd_stdio_and_exit_status(tmp_path, monkeypatch):
    path = script(tmp_path, """
        import json, os, sys
        print(json.dumps({"argv": sys.argv, "rank": os.environ.get("RANK"), "agent": os.environ.get("AGENT_ONLY"),
                          "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__}))
        print("to stderr", file=sys.stderr)
        sys.exit(int(os.environ["CODE"]))
    """)
    monkeypatch.chdir(tmp_path)

    async def main():
        zygote = await Zygote.start({**os.environ, "AGENT_ONLY": "1"}, GUARD, preload=("json",))
        try:
            rank = await _spawn(zygote, Program(str(path), False, ("--lr", "0.1"), True), tmp_path,
                                {"RANK": "3", "CODE": "7"})
            assert await rank.wait() == 7 and rank.returncode == 7
            failing = script(tmp_path, "raise RuntimeError('bad batch')\n")
            rank = await _spawn(zygote, Program(str(failing), False, (), False), tmp_path, name="failing")
            assert await rank.wait() == 1
        finally:
            zygote.close()

    run(main())

    seen = json.loads((tmp_path / "out.txt").read_text())
    assert seen == {"argv": [str(path), "--lr", "0.1"], "rank": "3", "agent": None, "cwd": str(tmp_path),
                    "path0": str(tmp_path), "name": "__main__"}
    assert (tmp_path / "out.err").read_text() == "to stderr\n"
    assert "RuntimeError: bad batch" in (tmp_path / "failing.err").read_text()


@pytest.mark.timeout(60)
def test_a_killed_rank_reports_its_signal_and_the_ranks_die_with_the_zygote(tmp_path):
    path = script(tmp_path, "import time\ntime.sleep(60)\n")

    async def main():
        zygote = await Zygote.start(dict(os.environ), GUARD, preload=())
        first = await _spawn(zygote, Program(str(path), False, (), False), tmp_path)
        first.kill()
        assert await first.wait() == -signal.SIGKILL
        second = await _spawn(zygote, Program(str(path), False, (), False), tmp_path)
        os.kill(zygote.process.pid, signal.SIGKILL)  # the zygote dies: its ranks with it
        assert await second.wait() == -signal.SIGKILL
        await asyncio.to_thread(wait_until, lambda: not process_alive(second.pid), 5, "the rank to die")
        with pytest.raises(ZygoteLost):
            await _spawn(zygote, Program(str(path), False, (), False), tmp_path)
        await zygote.process.wait()

    run(main())


@pytest.mark.timeout(60)
def test_a_zygote_that_does_not_answer_a_fork_is_ended_within_the_bound(tmp_path):
    """A stopped zygote would leave the slot starting for good: past the bound it is ended (it could
    not report its ranks' exits either) and the caller told, to start ranks cold."""
    path = script(tmp_path, "import time\ntime.sleep(60)\n")

    async def main():
        zygote = await Zygote.start(dict(os.environ), GUARD, preload=())
        await zygote.ready()
        os.kill(zygote.process.pid, signal.SIGSTOP)
        out = open(tmp_path / "out.txt", "wb")
        try:
            with pytest.raises(ZygoteLost, match="no answer to a fork in 1s"):
                await zygote.spawn(Program(str(path), False, (), False), {"PATH": os.environ["PATH"]},
                                   (0, out.fileno(), out.fileno()), answer_wait_s=1.0)
        finally:
            out.close()
        assert zygote.lost
        assert await asyncio.wait_for(zygote.process.wait(), 10) == -signal.SIGKILL

    run(main())


@pytest.mark.timeout(60)
def test_a_module_runs_as_with_python_dash_m(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)

    async def main():
        zygote = await Zygote.start(dict(os.environ), GUARD, preload=())
        try:
            rank = await _spawn(zygote, Program("pkg.train", True, ("-x",), False), tmp_path)
            assert await rank.wait() == 0
        finally:
            zygote.close()

    run(main())
    assert (tmp_path / "out.txt").read_text() == "__main__ ['-x']\n"


@pytest.mark.timeout(60)
def test_a_forked_rank_marks_its_completion_before_teardown_and_a_failing_one_does_not(tmp_path):
    done = script(tmp_path, "import atexit, os\natexit.register(os.abort)\n")  # completes, then aborts
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nsys.exit(3)\n")

    async def main():
        zygote = await Zygote.start(dict(os.environ), GUARD, preload=())
        try:
            rank = await _spawn(zygote, Program(str(done), False, (), False), tmp_path,
                                {COMPLETED_FILE_ENV: str(tmp_path / "done.mark")})
            assert await rank.wait() == -signal.SIGABRT
            rank = await _spawn(zygote, Program(str(failing), False, (), False), tmp_path,
                                {COMPLETED_FILE_ENV: str(tmp_path / "failing.mark")})
            assert await rank.wait() == 3
        finally:
            zygote.close()

    run(main())
    assert (tmp_path / "done.mark").exists() and not (tmp_path / "failing.mark").exists()



# How scripts end, each run cold (`python SCRIPT`) and forked: the same status, stdout and stderr.
ENDINGS = {
    "returns": """
        import atexit, threading, time
        class Freed:
            def __del__(self):
                print("global freed", flush=True)
        kept = Freed()
        atexit.register(print, "atexit ran")
        def late():
            time.sleep(0.3)
            print("thread done")
        threading.Thread(target=late).start()
        print("unflushed", end="")  # (a file: block-buffered until the exit flushes it)
    """,
    "exits_3": "import sys\nprint('bye')\nsys.exit(3)\n",
    "exits_with_a_message": "import sys\nsys.exit('no data at /data')\n",
    "raises": "def load():\n    raise ValueError('bad shard 7')\nload()\n",
    "interrupted": "raise KeyboardInterrupt\n",
    "prints_from_c": "import ctypes\nctypes.CDLL(None).printf(b'from C')\n",
    "aborts_in_a_destructor": "import os\nclass A:\n    def __del__(self):\n        os.abort()\na = A()\n",
}


@pytest.mark.timeout(90)
def test_a_forked_rank_ends_as_python_script_ends(tmp_path):
    """Its own teardown without the zygote's (`runner.end_forked`): threads joined, atexit run, its
    globals freed, output flushed (libc's too), and the status an interpreter's exit gives."""
    paths = {name: script(tmp_path, body).rename(tmp_path / f"{name}.py") for name, body in ENDINGS.items()}
    cold = {}
    for name, path in paths.items():
        done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=30, cwd=tmp_path)
        cold[name] = (done.returncode, done.stdout, done.stderr)

    async def main():
        zygote = await Zygote.start(dict(os.environ), GUARD, preload=("ctypes",))
        try:
            return {name: await (await _spawn(zygote, Program(str(path), False, (), False), tmp_path,
                                              name=name)).wait() for name, path in paths.items()}
        finally:
            zygote.close()

    codes = run(main())
    warm = {name: (codes[name], (tmp_path / f"{name}.txt").read_text(), (tmp_path / f"{name}.err").read_text())
            for name in paths}
    assert cold["returns"] == (0, "unflushedthread done\natexit ran\nglobal freed\n", "")  # the order of an exit
    for name in paths:
        assert warm[name] == cold[name], name


@pytest.mark.timeout(30)
def test_the_exit_of_a_rank_gone_before_the_agent_reads_its_pid_still_ends_it():
    """A loaded agent may read the zygote's answer and the rank's exit in one go: the exit must
    still reach the rank's handle (it was dropped, and the slot waited on a dead rank). The test
    plays the zygote's end of the channel, so both messages wait before the agent reads either."""

    async def main():
        agent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        agent_end.setblocking(False)
        zygote = Zygote(agent_end, SimpleNamespace(returncode=0))
        try:
            zygote_end.send(json.dumps({"ready": 1}).encode())
            spawning = asyncio.ensure_future(zygote.spawn(Program("rank.py", False, (), False), {}, (0, 1, 2)))
            while not select.select([zygote_end], [], [], 0)[0]:
                await asyncio.sleep(0.005)  # until the request is sent
            request, fds, _, _ = socket.recv_fds(zygote_end, 1 << 20, 3)
            for fd in fds:
                os.close(fd)
            zygote_end.send(json.dumps({"id": json.loads(request)["id"], "pid": 4242}).encode())
            zygote_end.send(json.dumps({"exited": 4242, "code": 3, "cpu_s": 0.5}).encode())
            rank = await spawning
            assert await asyncio.wait_for(rank.wait(), 5) == 3 and zygote.reaped_cpu_s == 0.5
        finally:
            zygote._lose("test over", quiet=True)
            zygote_end.close()

    run(main())


@pytest.mark.timeout(120)
def test_forked_ranks_draw_their_own_random_numbers(tmp_path):
    """random, numpy and torch are seeded from the OS in a new interpreter: two ranks forked from
    one zygote (which imported numpy and torch, seeding both) must not share their draws."""
    path = script(tmp_path, """
        import json, random
        import numpy, torch
        print(json.dumps([random.random(), float(numpy.random.rand()), torch.rand(1).item()]))
    """)

    async def main():
        zygote = await Zygote.start(dict(os.environ), GUARD, preload=("numpy", "torch"))
        try:
            for name in ("a", "b"):
                rank = await _spawn(zygote, Program(str(path), False, (), False), tmp_path, name=name)
                assert await rank.wait() == 0
        finally:
            zygote.close()

    run(main())
    a, b = (json.loads((tmp_path / f"{n}.txt").read_text()) for n in ("a", "b"))
    assert all(x != y for x, y in zip(a, b)), (a, b)


@pytest.mark.timeout(120)
def test_the_zygote_learns_the_packages_a_rank_imported_and_leaves_unsafe_ones_to_the_ranks(tmp_path, caplog):
    """A rank records the installed packages it imported (the runner, after MUSTER_IMPORTS_AFTER);
    a successor forked from the first zygote imports them and serves later starts, which find them
    loaded. One that starts a thread at import is named once and left to the ranks. The zygote
    serving ranks is kept; the first stays (it forks each successor), a succeeded successor ends
    with its last rank, and every successor dies with the first."""
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "heavy_pkg.py").write_text("")
    (site / "later_pkg.py").write_text("")
    # A non-daemon thread: the zygote that imports it must not wait for it; a rank's (0 s) is
    # waited for at its exit, as under `python SCRIPT`.
    (site / "threading_pkg.py").write_text("import os, threading, time\n"
                                           "threading.Thread(target=time.sleep, args=(float(os.environ.get("
                                           "'THREAD_S', '60')),)).start()\n")
    path = script(tmp_path, """
        import sys
        print(sorted(m for m in ("heavy_pkg", "later_pkg", "threading_pkg") if m in sys.modules), flush=True)
        import heavy_pkg, threading_pkg, time
        time.sleep(float(sys.argv[1]))
    """)
    env = {**os.environ, "PYTHONPATH": str(site)}
    ranks = {**env, "THREAD_S": "0"}

    async def main():
        warm = WarmStarts(env, GUARD, ("json",))
        await warm.start()
        try:
            imports = tmp_path / "imports"
            first = await _spawn(warm, Program(str(path), False, ("30",), False), tmp_path,
                                 {**ranks, "MUSTER_IMPORTS_FILE": str(imports), "MUSTER_IMPORTS_AFTER": "0.2"}, "first")
            await asyncio.to_thread(wait_until, imports.exists, 30, "the rank's imports recorded")
            assert imports.read_text().split() == ["heavy_pkg", "threading_pkg"]
            origin = warm.zygote
            warm.learn(imports.read_text().split())
            await asyncio.wait_for(warm._learning, 60)
            assert warm.learned == ("heavy_pkg",) and warm.refused == {"threading_pkg"}
            successor = warm.zygote
            assert successor is not origin and origin is warm.first and not origin.retiring and not origin.lost
            assert successor.process.pid in _children(origin.process.pid)  # forked: torch is not imported twice
            second = await _spawn(warm, Program(str(path), False, ("30",), False), tmp_path, ranks, "second")
            warm.learn(["later_pkg"])
            await asyncio.wait_for(warm._learning, 60)
            assert warm.learned == ("heavy_pkg", "later_pkg") and warm.zygote is not successor
            assert successor.retiring and not successor.lost  # its rank still runs
            third = await _spawn(warm, Program(str(path), False, ("0",), False), tmp_path, ranks, "third")
            assert await third.wait() == 0
            # (its line first: a fresh-clone run, at a load of 20, killed it before it printed)
            await asyncio.to_thread(wait_until, lambda: (tmp_path / "second.txt").read_text(), 20, "the second's line")
            second.kill()
            assert await second.wait() == -signal.SIGKILL
            await asyncio.to_thread(wait_until, lambda: successor.lost, 10, "the succeeded zygote to end with its rank")
            first.kill()
            assert await first.wait() == -signal.SIGKILL
            assert not origin.lost  # it forks the next successor
            last = warm.zygote.process.pid
            origin.close()  # the first zygote gone: its successors go with it (PDEATHSIG)
            await asyncio.to_thread(wait_until, lambda: not process_alive(last), 10, "the successor to die with the first")
        finally:
            warm.close()

    run(main())
    assert (tmp_path / "first.txt").read_text() == "[]\n"
    assert (tmp_path / "second.txt").read_text() == "['heavy_pkg']\n"
    assert (tmp_path / "third.txt").read_text() == "['heavy_pkg', 'later_pkg']\n"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


@pytest.mark.timeout(60)
def test_a_warm_rank_shows_its_script_command_line_in_ps_not_the_zygotes(tmp_path):
    path = script(tmp_path, "import time\ntime.sleep(60)\n")

    async def main():
        zygote = await Zygote.start({**os.environ, "RUN_TAG": "t1"}, GUARD, preload=("json",))
        try:
            args = ("--lr", "0.1", "--data", "x" * 1000)  # a title far longer than the zygote's own command line
            rank = await _spawn(zygote, Program(str(path), False, args, True), tmp_path, {"RANK": "3"})
            expected = f"{sys.executable} -u {path} {' '.join(args)}"
            wait_until(lambda: _cmdline(rank.pid) == expected, 10, "the rank's title")
            # the title leaves the environment's memory alone: it shows the zygote's, as tools expect
            environ = open(f"/proc/{rank.pid}/environ", "rb").read().split(b"\0")
            assert b"RUN_TAG=t1" in environ and b"RANK=3" not in environ
            rank.kill()
            assert await rank.wait() == -signal.SIGKILL
        finally:
            zygote.close()

    run(main())


def _cmdline(pid: int) -> str:
    return open(f"/proc/{pid}/cmdline", "rb").read().rstrip(b"\0").replace(b"\0", b" ").decode()


@pytest.mark.timeout(90)
@pytest.mark.skipif("[madvise]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
                    reason="transparent huge pages are off, or always on (without the switch too), on this host")
def test_a_warm_rank_given_thp_mem_alloc_enable_holds_its_large_tensors_on_huge_pages(tmp_path):
    """`--env THP_MEM_ALLOC_ENABLE=1` (the agent's zygote and its ranks share --env) reaches torch in a
    rank forked from a zygote that imported torch: a 256 MiB tensor lies on transparent huge pages
    (which the kernel frees ~4x faster at a kill, so the rank's death is heard sooner); without it,
    on none (the agent's default)."""

    path = script(tmp_path, """
        import torch
        t = torch.ones(64 << 20)  # 256 MiB
        rollup = open("/proc/self/smaps_rollup").read().split("\\n")
        print(next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")))
    """)

    async def main(defaults, name):
        zygote = await Zygote.start({**os.environ, **defaults}, GUARD, preload=("torch",))
        try:
            rank = await _spawn(zygote, Program(str(path), False, (), False), tmp_path, env=defaults, name=name)
            assert await rank.wait() == 0, (tmp_path / f"{name}.err").read_text()
        finally:
            zygote.close()

    run(main({"OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1"}, "on"))
    run(main({"OMP_NUM_THREADS": "1"}, "off"))
    on, off = (int((tmp_path / f"{n}.txt").read_text()) for n in ("on", "off"))
    assert on >= 200 << 10 and off < on // 4, (on, off)  # kB: most of the 256 MiB, against (nearly) none


@pytest.mark.timeout(120)
def test_a_training_rank_forked_from_the_shared_zygote_is_seen_as_a_child_process(tmp_path):
    """`TrainingProcess(warm=True)` (the `training` fixture's ranks): forked from this process's one
    zygote, a rank is polled, waited for (within a bound) and killed by PID as a Popen is, its output
    goes to its log, and its CPU is counted once it ends (conftest's per-test CPU adds it)."""
    path = script(tmp_path, """
        import os, sys, time
        t = time.process_time()
        while time.process_time() - t < 0.3:
            pass
        print(os.environ["GREETING"], sys.argv[1:], flush=True)
        time.sleep(float(sys.argv[1]))
    """)
    warm = WarmRanks.shared()
    assert warm.spawn(["/bin/sleep", "1"], {}, 1) is None  # not this interpreter running Python: started cold
    before = WarmRanks.reaped_cpu_s()
    with open(tmp_path / "a.log", "wb") as out:
        a = warm.spawn([sys.executable, str(path), "60"], {"GREETING": "hello"}, out.fileno())
    with open(tmp_path / "b.log", "wb") as out:
        b = warm.spawn([sys.executable, str(path), "0"], {"GREETING": "hi"}, out.fileno())
    assert b.wait(30) == 0 and b.poll() == 0
    # (a's 0.3 s of CPU before its greeting can outlast b on a loaded host: killed before it, a says nothing)
    wait_until(lambda: (tmp_path / "a.log").read_text(), 30, "a's greeting in its log")
    assert a.poll() is None and process_alive(a.pid)
    with pytest.raises(subprocess.TimeoutExpired):
        a.wait(0.1)
    a.kill()
    assert a.wait(10) == -signal.SIGKILL and not process_alive(a.pid)
    assert (tmp_path / "a.log").read_text() == "hello ['60']\n" and (tmp_path / "b.log").read_text() == "hi ['0']\n"
    assert WarmRanks.reaped_cpu_s() - before >= 0.5  # both ranks' busy 0.3 s


@pytest.mark.timeout(120)
def test_a_hosts_zygote_forks_each_agents_zygote_which_its_agent_ends_by_closing_its_channel(tmp_path):
    """`muster zygote --socket S`: an agent's zygote is forked from it with the agent's environment
    (its ranks the host zygote's grandchildren), and ends when the agent's end closes, its ranks
    with it; one that would see another module path is refused, and the agent starts its own; a
    second host zygote at the same socket is refused; SIGTERM ends it and removes its socket, and
    ends no agent's zygote nor rank."""
    sock = str(tmp_path / "z.sock")
    said = tmp_path / "host.err"  # (a file: a pipe nobody reads blocks the zygote and its children once full)
    with open(said, "w") as err:
        host = subprocess.Popen([sys.executable, "-m", "muster.cli", "zygote", "--socket", sock, "--preload", "json"],
                                stderr=err, start_new_session=True)
    try:
        wait_until(lambda: os.path.exists(sock), 30, "the host zygote's socket")
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        path = script(tmp_path, """
            import os, sys, time
            print(os.getppid(), os.environ["AGENT_ONLY"], os.getcwd(), flush=True)
            time.sleep(60)
        """)
        env = {**os.environ, "AGENT_ONLY": "yes"}

        async def main():
            zygote = await Zygote.connect(sock, env, preload=("json",))
            try:
                rank = await _spawn(zygote, Program(str(path), False, (), True), tmp_path, {"AGENT_ONLY": "rank"})
                await asyncio.to_thread(wait_until, lambda: (tmp_path / "out.txt").read_text(), 20, "the rank's line")
                parent = int((tmp_path / "out.txt").read_text().split()[0])
                assert Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(host.pid)
            finally:
                zygote.close()  # as the agent's exit does
            parent, seen, cwd = (tmp_path / "out.txt").read_text().split()
            assert (seen, cwd) == ("rank", os.getcwd())
            await asyncio.to_thread(wait_until, lambda: not process_alive(rank.pid), 10, "the rank to die with its zygote")
            assert not process_alive(int(parent))
            return int(parent)

        agent_zygote = run(main())
        assert agent_zygote != host.pid and host.poll() is None

        async def elsewhere():
            with pytest.raises(ZygoteLost, match="PYTHONPATH"):
                await Zygote.connect(sock, {**env, "PYTHONPATH": str(tmp_path)}, preload=("json",))
            warm = WarmStarts(env, GUARD, ("json",), host_zygote=str(tmp_path / "none.sock"))
            await warm.start()  # nothing listens there: its own zygote, the agent's child
            try:
                assert warm.first.process is not None
                await warm.first.ready()
            finally:
                warm.close()

        run(elsewhere())
        second = subprocess.run([sys.executable, "-m", "muster.cli", "zygote", "--socket", sock], capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 1 and "already listens" in second.stderr

        async def outlived():  # the host's zygote ends: an agent's zygote, and its ranks, go on
            zygote = await Zygote.connect(sock, env, preload=("json",))
            try:
                sleeper = await _spawn(zygote, Program(str(path), False, (), True), tmp_path, {"AGENT_ONLY": "a"}, "a")
                host.send_signal(signal.SIGTERM)
                try:  # (bounded generously: a fresh-clone run's host, at a load of 25, took over 10 s)
                    code = await asyncio.to_thread(host.wait, 30)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"the host's zygote runs 30 s after SIGTERM:\n{said.read_text()}") from None
                assert code == 128 + signal.SIGTERM and not os.path.exists(sock), said.read_text()
                later = await _spawn(zygote, Program(str(path), False, (), True), tmp_path, {"AGENT_ONLY": "b"}, "b")
                await asyncio.to_thread(wait_until, lambda: (tmp_path / "b.txt").read_text(), 20, "the later rank")
                assert process_alive(sleeper.pid) and process_alive(later.pid)
            finally:
                zygote.close()
            for rank in (sleeper, later):
                await asyncio.to_thread(wait_until, lambda: not process_alive(rank.pid), 10, "the ranks to end with it")

        run(outlived())
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(10)


@pytest.mark.timeout(120)
def test_a_process_on_a_host_with_a_zygote_forks_its_warm_ranks_from_that_one(tmp_path):
    """WarmRanks where MUSTER_ZYGOTE_SOCKET names a host's zygote (a benchmark a test runs, whose
    worker's zygote is the host's): its ranks are that zygote's grandchildren, not a second
    zygote's importing torch again, and are waited for as its own."""
    host = WarmRanks.shared()
    path = script(tmp_path, """
        import os
        print(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1], flush=True)
    """)
    program = textwrap.dedent(f"""
        import os, sys
        from muster.local import WarmRanks
        with open({str(tmp_path / 'rank.log')!r}, "wb") as out:
            rank = WarmRanks.shared().spawn([sys.executable, {str(path)!r}], dict(os.environ), out.fileno())
        print(rank.wait(30))
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=90,
                          env={**os.environ, "MUSTER_ZYGOTE_SOCKET": host.socket_path})
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]
    assert (tmp_path / "rank.log").read_text().strip() == str(host._zygote.process.pid)


@pytest.mark.timeout(120)
def test_a_rank_forked_from_a_successor_ends_through_the_interpreters_teardown(tmp_path):
    """As under `python SCRIPT`: its atexit handlers run, its block-buffered stdout is flushed, and
    what teardown does decides its exit status (it returned into the successor's frames, which
    ended it with os._exit(0): exit 0, no atexit, the buffered lines lost)."""
    path = script(tmp_path, """
        import atexit, os, sys
        class AbortsWhenFreed:
            def __del__(self):
                os.abort()
        print("buffered")
        atexit.register(print, "atexit ran")
        if sys.argv[1] == "abort":
            freed_in_teardown = AbortsWhenFreed()
    """)

    async def main():
        first = await Zygote.start(dict(os.environ), GUARD, preload=("json",))
        try:
            successor = await first.fork_successor(("csv",))
            await successor.ready()
            clean = await _spawn(successor, Program(str(path), False, ("clean",), False), tmp_path, name="clean")
            aborts = await _spawn(successor, Program(str(path), False, ("abort",), False), tmp_path, name="abort")
            return await asyncio.wait_for(clean.wait(), 30), await asyncio.wait_for(aborts.wait(), 30)
        finally:
            first.close()

    assert run(main()) == (0, -signal.SIGABRT)
    assert (tmp_path / "clean.txt").read_text() == "buffered\natexit ran\n"
