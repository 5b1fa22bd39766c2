"""Warm starts: ranks forked from a real zygote process see what `python SCRIPT` would show them,
report their exit status, and die with the zygote."""

import asyncio
import os
import signal
import sys
import textwrap

import pytest

from muster.local import process_alive, wait_until
from muster.worker.zygote import Program, Zygote, ZygoteLost, warm_program

GUARD = [sys.executable, "-m", "muster.worker.orphan_guard", str(os.getpid())]


def test_only_the_agents_own_interpreter_runs_warm():
    py = sys.executable
    assert warm_program([py, "-u", "train.py", "--lr", "1"]) == Program("train.py", False, ("--lr", "1"), True)
    assert warm_program([py, "-m", "pkg.train", "-x"]) == Program("pkg.train", True, ("-x",), False)
    assert warm_program([py, "-X", "dev", "train.py"]) is None  # options that change how Python starts
    assert warm_program([py, "-c", "print(1)"]) is None
    assert warm_program(["/usr/bin/env", "python", "train.py"]) is None
    assert warm_program(["/bin/sh", "train.sh"]) is None
    assert warm_program([py]) is None


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
    import json

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
