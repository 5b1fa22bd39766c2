"""The rank runner: a program runs as under `python SCRIPT`, and its completion is marked before
interpreter teardown, never for a failure."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from muster.local import wait_until
from muster.worker.rank.runner import COMPLETED_FILE_ENV, Program, python_program, runner_argv

SEEN = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "path0": sys.path[0], "name": __name__, "file": __file__,
                  "main": sys.modules["__main__"].__file__, "marker": os.environ.get("MUSTER_COMPLETED_FILE")}))
"""


def test_only_the_agents_own_interpreter_runs_python_programs(tmp_path):
    py = sys.executable
    assert python_program([py, "-u", "train.py", "--lr", "1"]) == Program("train.py", False, ("--lr", "1"), True)
    assert python_program([py, "-m", "pkg.train", "-x"]) == Program("pkg.train", True, ("-x",), False)
    assert python_program([py, "-X", "dev", "train.py"]) is None  # options that change how Python starts
    assert python_program([py, "-c", "print(1)"]) is None
    assert python_program(["/usr/bin/env", "python", "train.py"]) is None
    assert python_program(["/bin/sh", "train.sh"]) is None
    assert python_program([py]) is None
    # another name of the same interpreter in its directory (a venv's `python` beside the `python3`
    # of a pip-installed `muster`'s first line) is the same; the binary it links to elsewhere is not
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").symlink_to(os.path.realpath(py))
    (bin_dir / "python").symlink_to("python3")
    assert python_program([str(bin_dir / "python"), "train.py"], str(bin_dir / "python3")) == Program(
        "train.py", False, (), False)
    assert python_program([os.path.realpath(py), "train.py"], str(bin_dir / "python3")) is None
    # the same venv reached through a symlinked directory (a checkout whose .venv links to another's)
    (tmp_path / "linked").symlink_to(tmp_path / "venv")
    assert python_program([str(tmp_path / "linked" / "bin" / "python"), "train.py"], str(bin_dir / "python3")) \
        == Program("train.py", False, (), False)
    assert runner_argv(Program("t.py", False, ("-x",), True), py) == [py, "-u", "-m", "muster.worker.rank.runner",
                                                                        "t.py", "-x"]
    assert runner_argv(Program("pkg.t", True, (), False), py) == [py, "-m", "muster.worker.rank.runner", "-m", "pkg.t"]


def run(tmp_path, body: str, *args: str, runner: bool = True, module: bool = False):
    """(exit code, stdout, stderr, marked) of the program, run through the runner or by python."""
    (tmp_path / "prog.py").write_text(textwrap.dedent(body))
    marker = tmp_path / "completed"
    marker.unlink(missing_ok=True)
    target = ["-m", "prog"] if module else ["prog.py"]
    argv = [sys.executable, *(["-m", "muster.worker.rank.runner"] if runner else []), *target, *args]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env={**os.environ, COMPLETED_FILE_ENV: str(marker)})
    return done.returncode, done.stdout, done.stderr, marker.exists()


@pytest.mark.parametrize("end", ["", "import sys; sys.exit(0)", "import sys; sys.exit()", "raise SystemExit(None)"])
def test_a_program_that_returns_or_exits_0_is_marked_completed(tmp_path, end):
    assert run(tmp_path, f"print('trained')\n{end}\n") == (0, "trained\n", "", True)


@pytest.mark.parametrize("end, code", [("raise ValueError('bad batch')", 1), ("import sys; sys.exit(2)", 2),
                                       ("import sys; sys.exit('usage: prog')", 1)])
def test_a_failing_program_is_not_completed_and_fails_as_under_python(tmp_path, end, code):
    body = f"def train():\n    {end}\ntrain()\n"
    through = run(tmp_path, body)
    plain = run(tmp_path, body, runner=False)
    assert through[0] == plain[0] == code
    assert not through[3]
    assert through[2] == plain[2]  # the same traceback: the program's frames only


def test_a_program_completed_then_aborting_in_teardown_is_marked(tmp_path):
    body = """
        import os
        class AbortsWhenFreed:
            def __del__(self):
                os.abort()
        kept_until_teardown = AbortsWhenFreed()
        print("done", flush=True)
    """
    assert run(tmp_path, body) == (-signal.SIGABRT, "done\n", "", True)


def test_the_program_sees_what_python_shows_it_and_not_the_marker(tmp_path):
    code, out, _, marked = run(tmp_path, SEEN, "--lr", "0.1")
    seen = json.loads(out)
    plain = json.loads(run(tmp_path, SEEN, "--lr", "0.1", runner=False)[1])
    script = str(tmp_path / "prog.py")
    assert code == 0 and marked
    assert seen == {**plain, "marker": None} == {"argv": ["--lr", "0.1"], "path0": str(tmp_path), "name": "__main__",
                                                 "file": script, "main": script, "marker": None}


def test_a_module_runs_as_with_python_dash_m(tmp_path):
    code, out, _, marked = run(tmp_path, SEEN, "-x", module=True)
    assert code == 0 and marked
    assert json.loads(out) == {**json.loads(run(tmp_path, SEEN, "-x", runner=False, module=True)[1]), "marker": None}


def test_recording_the_imports_changes_nothing_of_the_programs_teardown(tmp_path):
    """The recording timer is gone before interpreter teardown: a live thread there changes what
    finalization frees (an object aborting in __del__ did not run it)."""
    script = tmp_path / "aborts_in_teardown.py"
    script.write_text("import os\nclass A:\n    def __del__(self):\n        os.abort()\nx = A()\n")
    env = {**os.environ, "MUSTER_IMPORTS_FILE": str(tmp_path / "imports")}
    done = subprocess.run([sys.executable, "-m", "muster.worker.rank.runner", str(script)], env=env, timeout=60)
    assert done.returncode == -signal.SIGABRT


def test_a_rank_records_the_installed_modules_it_imported_submodules_included(tmp_path):
    """Submodules too: a package that loads them lazily (transformers) imports little itself."""
    site = tmp_path / "site-packages"
    (site / "lazy_pkg").mkdir(parents=True)
    (site / "some_pkg.py").write_text("")
    (site / "lazy_pkg" / "__init__.py").write_text("")
    (site / "lazy_pkg" / "trainer.py").write_text("")
    (tmp_path / "local_mod.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text("import time, some_pkg, local_mod\nimport lazy_pkg.trainer\ntime.sleep(30)\n")
    imports = tmp_path / "imports"
    env = {**os.environ, "PYTHONPATH": str(site), "MUSTER_IMPORTS_FILE": str(imports), "MUSTER_IMPORTS_AFTER": "0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "muster.worker.rank.runner", str(script)], env=env)
    try:
        wait_until(imports.exists, 30, "the imports recorded")
        # installed, not the script's own module; in the order imported
        assert imports.read_text().split() == ["some_pkg", "lazy_pkg", "lazy_pkg.trainer"]
    finally:
        proc.kill()
        proc.wait(10)
