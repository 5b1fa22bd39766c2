"""Two "hosts" (the root network namespace and one behind a veth pair) run one job from the docs'
own command lines, with no --host: each agent advertises its address on the route to the
coordinator, not 127.0.0.1, so the other node's ranks reach its store and its ranks. The library's
example, and an unmodified gloo script: its ranks get the interface holding that address
(GLOO_SOCKET_IFNAME), where gloo alone binds to the hostname's address and dials loopback. Needs
root (network namespaces); skipped with the reason otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import NetNamespace
from muster.local import CoordinatorProcess

pytestmark = pytest.mark.timeout(150)


LIBRARY = ["torchrun", "--nproc-per-node", "1", "-m", "muster.examples.train_ddp", "--steps", "30", "--step-sleep", "0.02"]
PLAIN = [sys.executable, str(Path(__file__).parents[2] / "examples" / "train_plain.py"), "--steps", "30",
         "--step-sleep", "0.02", "--checkpoint-dir"]  # + a directory per node


@pytest.mark.parametrize("script", ["library", "plain"])
def test_a_job_over_two_hosts_forms_from_the_docs_command_lines_without_host(etcd, tmp_path, script):
    why = NetNamespace.unavailable()
    if why:
        pytest.skip(why)
    ns = NetNamespace("twoh").create()
    serve = CoordinatorProcess([etcd.endpoint], tmp_path / "serve.log", ["--insecure"],
                               listen=f"{ns.host_ip}:0")
    agents = []
    try:
        serve.start()
        # getting-started's command line, sized for one CPU rank a node
        run = [str(Path(sys.executable).parent / "muster"), "--log-json", "run", "--coordinator", serve.address,
               "--job", "twohosts", "--nodes", "2", "--"]
        for name, wrap in (("inside", ns.wrap()), ("outside", [])):
            command = LIBRARY if script == "library" else [*PLAIN, str(tmp_path / f"ckpt-{name}")]
            log = open(tmp_path / f"{name}.log", "w")
            agents.append((name, subprocess.Popen([*wrap, *run, *command], stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True)))
        codes = {name: p.wait(120) for name, p in agents}
        logs = {name: (tmp_path / f"{name}.log").read_text() for name, _ in agents}
        assert codes == {"inside": 0, "outside": 0}, {n: t[-3000:] for n, t in logs.items()}
        joined = {name: next(json.loads(line) for line in text.splitlines() if '"node_joined"' in line)
                  for name, text in logs.items()}
        assert joined["inside"]["host"] == ns.node_ip and joined["outside"]["host"] == ns.host_ip, joined
        assert not any("which other hosts cannot reach" in t for t in logs.values())
        if script == "plain":  # formed at once: every step at world size 2, no restart
            steps = [json.loads(line) for text in logs.values() for line in text.splitlines()
                     if line.startswith('{"event": "step"')]
            assert {(s["rank"], s["world_size"], s["restart_count"]) for s in steps} == {(0, 2, 0), (1, 2, 0)}, steps[-4:]
    finally:
        for _, p in agents:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        serve.stop()
        ns.delete()
