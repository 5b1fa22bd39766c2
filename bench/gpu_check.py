"""`make gpu-check`: the GPU path in one command, on a machine with CUDA.

1. `pytest tests/gpu`: a rank killed, the store host killed, a rank hung (SIGSTOP), a rank joining
   and a planned leave, at 4 and 8 ranks sharing the visible GPUs (one NCCL_HOSTID per process);
   FSDP2 on an HSDP mesh (2 x 2) losing a rank, refilled by a spare from the other replica;
2. `bench/recovery.py --backend nccl --ranks 8` (kills and hangs, per-phase timings), its JSON
   written to bench/results/nccl.json; then its kills again in each variant (--variants, VARIANTS
   below: NCCL settings that move or reduce the new communicator's connection setup, and faults in a
   new group's first steps) to bench/results/nccl_VARIANT.json;
3. models of real size (--sizes, default 134M,537M: square Linear layers with Adam, 4 ranks on the
   GPU): `bench/recovery.py --model SIZE` to bench/results/nccl_SIZE.json: kill and hang -> every
   survivor stepping, each survivor's state sync, the replacement's transfer rate beside a raw
   broadcast of the same bytes, and the healthy ranks evicted (none allowed);
4. `bench/nccl_connect.py --ranks 8` (--connect-probe): raw ranks, no coordinator, a rank lost;
   how soon the survivors' new communicator is ready, made afresh, with NCCL_RUNTIME_CONNECT=0,
   or shrunk from a warm standby made before the loss, to bench/results/nccl_connect.json;
5. a one-screen summary: the device, torch and NCCL, the tests' counts, and the recovery figures
   beside their targets (PASS/MISS).

Without CUDA it says so in one line and exits 0 (CI), or 2 with --require-gpu. `--backend gloo`
or `nccl-twin` runs the same harness on CPU (no CUDA check; results to .muster/).
Exit status: 0 when the tests passed and the benchmark ran (a missed target is reported, not
failed), 1 when a test or the benchmark failed, 2 without CUDA under --require-gpu.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILL_TARGET_S = 0.3  # kill -> every survivor stepping again, p50, 8 ranks on one GPU
HANG_MARGIN_S = 0.3  # hang -> every survivor stepping again, p50: the heartbeat timeout + this
SIZED_RANKS = 4  # the real-size rows: 4 ranks share the GPU (537M with Adam: 6.4 GB of state each)
SIZED_KILLS = 2
TRANSFER_SHARE = 0.5  # a replacement's state transfer at at least this share of a raw broadcast's rate
# The kills again, one way changed each (bench/recovery.py's flags). A new communicator makes its
# connections at its first collective (DDP's first all-reduce, after the reform): the first two ask
# where that time goes and whether it scales with the connections made.
VARIANTS = {
    "connect-in-init": ["--env", "NCCL_RUNTIME_CONNECT=0"],  # every connection made by the (eager) init
    "two-channels": ["--env", "NCCL_MIN_NCHANNELS=1", "--env", "NCCL_MAX_NCHANNELS=2"],  # fewer connections
    "first-steps": ["--settled-steps", "1"],  # faults in a new group's first steps (DDP's bucket rebuild)
}


def run_bounded(cmd: list[str], timeout_s: float, *, capture: bool = False,
                env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run `cmd` (its output on the terminal, or stdout returned with `capture`). Past `timeout_s`
    it gets SIGINT, on which pytest and the benchmark end the processes they started, then
    SIGKILL; the exit status is then None."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE if capture else None, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        print(f"gpu-check: {' '.join(cmd[1:3])} ran past {timeout_s:g}s: interrupted", file=sys.stderr)
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        return None, ""


def run_tests(backend: str, select: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="muster-gpu-check-") as d:
        junit = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "tests/gpu", f"--junitxml={junit}",
               *(["-k", select] if select else [])]
        started = time.monotonic()
        code, _ = run_bounded(cmd, timeout_s, env={**os.environ, "MUSTER_GPU_TEST_BACKEND": backend})
        counts = {"passed": 0, "failed": 0, "skipped": 0, "seconds": round(time.monotonic() - started)}
        if junit.exists():
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            counts.update(failed=n["failures"] + n["errors"], skipped=n["skipped"],
                          passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"])
        counts["ok"] = code == 0 and counts["failed"] == 0
        return counts


def run_bench(args: argparse.Namespace, out: Path, where: str, variant: str = "", sizes: str = "") -> dict | None:
    """bench/recovery.py's JSON, with the platform it ran on (`where`) added, written to `out`.
    `variant`: its kills alone, changed as VARIANTS says; `sizes`: models of real size at
    SIZED_RANKS ranks, instead of the tiny one at --ranks."""
    cmd = [sys.executable, "bench/recovery.py", "--backend", args.backend,
           "--ranks", str(SIZED_RANKS if sizes else args.ranks), "--model", sizes or "tiny",
           "--kills", str(SIZED_KILLS if sizes else args.kills),
           "--hangs", "0" if variant else str(min(1, args.hangs) if sizes else args.hangs), "--failovers", "0",
           *VARIANTS.get(variant, []),
           *(["--workdir", str(args.logs / (variant or ("sizes" if sizes else "plain")))] if args.logs else [])]
    code, text = run_bounded(cmd, args.bench_timeout, capture=True)  # its logs (stderr) go to the terminal
    if code != 0:
        print(f"gpu-check: bench/recovery.py{f' ({variant})' if variant else ''} failed "
              f"({'timed out' if code is None else f'exit {code}'})", file=sys.stderr)
        return None
    result = {**json.loads(text), "platform": where}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def run_probe(args: argparse.Namespace, out: Path, where: str) -> dict | None:
    """bench/nccl_connect.py's JSON (on CPU: its harness alone, gloo made afresh), written to `out`."""
    cmd = [sys.executable, "bench/nccl_connect.py", "--ranks", str(args.ranks),
           *(["--backend", "gloo", "--modes", "fresh"] if args.backend != "nccl" else [])]
    code, text = run_bounded(cmd, args.bench_timeout, capture=True)
    if code != 0:
        print(f"gpu-check: bench/nccl_connect.py failed ({'timed out' if code is None else f'exit {code}'})",
              file=sys.stderr)
        return None
    result = {**json.loads(text), "platform": where}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def probe_summary(probe: dict | None, ran: bool) -> list[str]:
    if not ran:
        return ["connect probe    not run (--no-connect-probe)"]
    if probe is None:
        return ["connect probe    no results (it failed)"]
    lines = [f"{'connect probe, ' + str(probe['ranks']) + ' ranks':22}{'make':>8}{'first':>8}{'bucket':>8}"]
    for mode, f in probe["modes"].items():
        if "error" in f:
            lines.append(f"  {mode:20}{f['error']}")
            continue
        make = f.get("init_s", f.get("shrink_s", float("nan")))
        lines.append(f"  {mode:20}{make:8.3f}{f['first_small_s']:8.3f}{f['first_big_s']:8.3f}")
    return lines


def platform(torch) -> str:
    if not torch.cuda.is_available():
        return f"CPU, torch {torch.__version__}"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return (f"{', '.join(names)} x{torch.cuda.device_count()}, torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), NCCL {nccl}")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def summary(args: argparse.Namespace, where: str, tests: dict, bench: dict | None,
            variants: dict[str, dict | None]) -> list[str]:
    lines = [f"== gpu-check: {args.backend} on {where}",
             f"tests/gpu        {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped "
             f"in {tests['seconds']} s{'' if tests['ok'] else '  FAILED'}"]
    if bench is None:
        return lines + ["recovery         no results (the benchmark failed)"]
    run = bench["runs"][0]
    faults = {name: run[name] for name in ("kill", "hang") if name in run}
    targets = {"kill": KILL_TARGET_S, "hang": bench["heartbeat_timeout_s"] + HANG_MARGIN_S}
    lines += [f"recovery         {run['ranks']} ranks, {args.kills} kills, {args.hangs} hangs "
              f"-> {os.path.relpath(args.out)}",
              f"{'every survivor steps':20}{'p50':>8} {'max':>8}   target"]
    for name, f in faults.items():
        p50, top = f[f"{name}_to_step_s"]["p50"], f[f"{name}_to_step_s"]["max"]
        lines.append(f"  after a {name:10}{p50:8.3f} {top:8.3f}   p50 <= {targets[name]:g} s"
                     f"{'':6}{verdict(p50 <= targets[name])}")
    for label, key in [("survivors lost", "survivors_lost"), ("healthy evicted", "healthy_evictions")]:
        total = sum(f[key] for f in faults.values())
        lines.append(f"  {label:18}{total:8d} {'':8}   0{'':17}{verdict(total == 0)}")
    lines.append(f"{'phase, s':22}" + "".join(f"{name + ' p50/max':>17}  " for name in faults).rstrip())
    for phase in faults["kill"]["phases"]:
        cells = [f"{f['phases'][phase]['p50']:.4f}/{f['phases'][phase]['max']:.4f}" if phase in f["phases"] else "-"
                 for f in faults.values()]
        lines.append(f"  {phase:20}" + "".join(f"{c:>17}  " for c in cells).rstrip())
    if not variants:
        return lines + ["variants         not run (--variants '')"]
    lines.append(f"{'variant, kills':20}{'p50':>8} {'max':>8} {'init':>7} {'first':>7}   lost evicted")
    for name, result in variants.items():
        if result is None:
            lines.append(f"  {name:18}no results (its benchmark failed)")
            continue
        kill = result["runs"][0]["kill"]
        init, first = (kill["phases"].get(p, {}).get("p50", float("nan")) for p in ("init_s", "first_collective_s"))
        lines.append(f"  {name:18}{kill['kill_to_step_s']['p50']:8.3f} {kill['kill_to_step_s']['max']:8.3f} "
                     f"{init:7.3f} {first:7.3f}   {kill['survivors_lost']:4d} {kill['healthy_evictions']:7d}")
    return lines


def sized_summary(sized: list[dict | None], sizes: str) -> list[str]:
    """The real-size rows: per model, the faults' recovery and what the state's movement cost."""
    if not sizes:
        return ["real sizes       not run (--sizes '')"]
    lines = [f"{'real sizes, 4 ranks':22}{'kill p50':>9}{'hang p50':>9}{'sync p50':>9}{'steady':>8}"
             f"{'rejoin':>8}{'MiB/s':>8}{'raw':>8}  evicted"]
    for size, result in zip([z for z in sizes.split(",") if z], sized):
        if result is None:
            lines.append(f"  {size:20}no results (its benchmark failed)")
            continue
        run = result["runs"][0]
        kill, hang = run["kill"], run.get("hang")
        state = kill.get("state", {})
        rate = state.get("state_rate_mib_s", {}).get("p50", 0.0)
        raw = run.get("raw_broadcast", {}).get("mib_s", 0.0)
        evicted = kill["healthy_evictions"] + (hang["healthy_evictions"] if hang else 0)
        lost = kill["survivors_lost"] + (hang["survivors_lost"] if hang else 0)
        lines.append(f"  {run['model']:20}{kill['kill_to_step_s']['p50']:9.3f}"
                     f"{hang['hang_to_step_s']['p50'] if hang else float('nan'):9.3f}"
                     f"{kill['phases'].get('sync_s', {}).get('p50', float('nan')):9.3f}{run['steady_step_s']:8.3f}"
                     f"{kill['rejoin_s']['p50']:8.2f}{rate:8.0f}{raw:8.0f}  {evicted}"
                     f"   {verdict(evicted == 0 and lost == 0)}"
                     f" transfer {verdict(bool(raw) and rate >= TRANSFER_SHARE * raw)}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("nccl", "nccl-twin", "gloo"), default="nccl",
                   help="the ranks' backend; gloo and nccl-twin run on CPU, without the CUDA check")
    p.add_argument("--require-gpu", action="store_true", help="without CUDA, fail (exit 2) instead of skipping")
    p.add_argument("--ranks", type=int, default=8, help="ranks of the benchmark (default 8)")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--hangs", type=int, default=3)
    p.add_argument("-k", dest="select", default="", help="pytest -k expression for tests/gpu (e.g. ranks4)")
    p.add_argument("--out", type=Path, help="the benchmark's JSON (default bench/results/nccl.json; "
                                            ".muster/gpu-check-BACKEND.json for a CPU backend)")
    p.add_argument("--tests-timeout", type=float, default=1800.0, help="seconds for all of tests/gpu")
    p.add_argument("--bench-timeout", type=float, default=1200.0, help="seconds for the benchmark")
    p.add_argument("--logs", type=Path, help="keep the benchmark's coordinator and rank logs here")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"the kills again in each of these ({', '.join(VARIANTS)}; default all; '' for none)")
    p.add_argument("--sizes", default="134M,537M",
                   help="models of real size to run at 4 ranks (default 134M,537M; '' for none)")
    p.add_argument("--connect-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="run bench/nccl_connect.py: a new communicator's readiness, by each way (default on)")
    p.add_argument("--tests", action=argparse.BooleanOptionalAction, default=True,
                   help="run tests/gpu (default on; --no-tests for the benchmarks alone)")
    args = p.parse_args()
    unknown = {v for v in args.variants.split(",") if v} - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))} ({', '.join(VARIANTS)})")
    args.out = args.out or ROOT / ("bench/results/nccl.json" if args.backend == "nccl"
                                   else f".muster/gpu-check-{args.backend}.json")
    import torch  # after the arguments: --help answers without it

    if args.backend == "nccl" and not torch.cuda.is_available():
        would = (f"pytest tests/gpu and bench/recovery.py --backend nccl --ranks {args.ranks} --kills {args.kills} "
                 f"--hangs {args.hangs}")
        if args.require_gpu:
            print(f"gpu-check: FAILED: --require-gpu and no CUDA device (torch {torch.__version__}); "
                  f"{would} not run", file=sys.stderr)
            return 2
        print(f"gpu-check: skipped, no CUDA device (torch {torch.__version__}): would run {would}")
        return 0
    where = platform(torch)
    tests = (run_tests(args.backend, args.select, args.tests_timeout) if args.tests
             else {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0, "ok": True})
    # One run a model, so that a slow larger one cannot take the smaller one's figures with it.
    sized = [run_bench(args, args.out.with_name(f"{args.out.stem}_{size}.json"), where, sizes=size)
             for size in args.sizes.split(",") if size]
    bench = run_bench(args, args.out, where)
    variants = {v: run_bench(args, args.out.with_name(f"{args.out.stem}_{v}.json"), where, variant=v)
                for v in args.variants.split(",") if v}
    probe = run_probe(args, args.out.with_name(args.out.stem + "_connect.json"), where) if args.connect_probe else None
    print("\n".join(summary(args, where, tests, bench, variants) + sized_summary(sized, args.sizes)
                    + probe_summary(probe, args.connect_probe)))
    return 0 if (tests["ok"] and bench is not None and None not in variants.values()
                 and None not in sized and (probe is not None or not args.connect_probe)) else 1


if __name__ == "__main__":
    sys.exit(main())
