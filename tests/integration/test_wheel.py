"""`pip install` of the built wheel, then `muster demo` from an empty directory: what the demo runs
ships inside the package (nothing is read from a checkout). The fresh venv installs only the wheel
(--no-deps); its dependencies come from this environment through a .pth file, which adds those
directories to the path without running their .pth files (so this checkout's editable install of
Muster stays out of it)."""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src")


def run(args, timeout, **kwargs):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert out.returncode == 0, f"{args[:4]} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.timeout(150)
def test_the_wheel_installs_and_its_demo_runs_from_an_empty_directory(tmp_path):
    # Build from a copy: the checkout may be in use (no build/ or egg-info written into it).
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, checkout / name, **({"ignore": shutil.ignore_patterns("__pycache__", "*.egg-info")}
                                         if (ROOT / name).is_dir() else {}))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(checkout)], 120)
    (wheel,) = (tmp_path / "dist").glob("torch_muster-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 60)
    python = venv / "bin" / "python"
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 30)
                   .stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    (purelib / "_muster_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], 120)

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = run([str(python), "-c", "import muster, muster.examples.train_ddp as t; print(muster.__file__, t.__file__)"],
                60, cwd=empty, env=env).stdout
    assert all(p.startswith(str(purelib)) for p in where.split()), where  # the wheel's, not the checkout's
    version = run([str(venv / "bin" / "muster"), "--version"], 60, cwd=empty, env=env).stdout
    assert version.strip() == "muster 0.1.0", version
    meta = run([str(python), "-c", "from importlib.metadata import metadata, entry_points as e; m = metadata('torch-muster');"
                " print(m['Name'], m.get_all('Provides-Extra'), [p.value for p in e(group='torchrun.handlers')])"],
               60, cwd=empty, env=env).stdout
    assert meta.split(" ", 1)[0] == "torch-muster" and "'embedded'" in meta and "muster.worker.torchrun.rendezvous" in meta, meta
    about = run([str(python), "-c", "from importlib.metadata import metadata; m = metadata('torch-muster'); "
                 "print(m['License-Expression'], *m.get_all('Project-URL'), sep='|')"], 60, cwd=empty, env=env).stdout
    assert about.split("|")[0] == "Apache-2.0" and "Repository, https://github.com/torch-muster/muster" in about, about
    page = run([str(python), "-c", "from importlib.resources import files; print(sorted(f.name for f in "
                "files('muster.web').iterdir() if f.suffix in ('.html', '.js', '.css')))"], 60, cwd=empty, env=env)
    assert page.stdout.split() == ["['app.js',", "'index.html',", "'style.css']"]  # muster serve --http's page

    demo = subprocess.run([str(venv / "bin" / "muster"), "--log-level", "warning", "demo", "--duration", "5",
                           "--nodes", "2", "--slots", "1"], capture_output=True, text=True, timeout=120, cwd=empty,
                          env=env)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "recovery:" in demo.stdout and "NOT RECOVERED" not in demo.stdout
    assert (empty / "muster-demo.png").stat().st_size > 0
