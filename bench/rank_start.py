"""What a rank (re)start costs before the script runs past its torch imports: forked from the
agent's warm zygote (the imports are done) against a cold start through the exec wrapper (a new
interpreter that imports what the zygote preloads); and the CPU seconds of such a rank's whole life,
start to exit, teardown included. Prints one JSON object.

    python bench/rank_start.py --starts 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recovery import summary  # noqa: E402

from muster.worker.rank.zygote import PRELOAD, Program, Zygote  # noqa: E402

FIRST_LINE = "import time\nprint(time.time(), flush=True)\n"


async def warm_starts(script: Path, guard: list[str], starts: int) -> tuple[list[float], list[float]]:
    zygote = await Zygote.start(dict(os.environ), guard)
    try:
        await zygote.ready()
        seconds, cpu_s = [], []
        for _ in range(starts):
            reaped = zygote.reaped_cpu_s
            read_end, write_end = os.pipe()
            began = time.time()
            rank = await zygote.spawn(Program(str(script), False, (), True), dict(os.environ), (0, write_end, 2))
            os.close(write_end)
            await rank.wait()
            cpu_s.append(zygote.reaped_cpu_s - reaped)  # (its exit's report comes before its end)
            seconds.append(float(os.read(read_end, 100).split()[0]) - began)
            os.close(read_end)
        return seconds, cpu_s
    finally:
        zygote.close()
        await zygote.process.wait()


def cold_starts(script: Path, guard: list[str], starts: int) -> tuple[list[float], list[float]]:
    imports = "".join(f"import {m}\n" for m in PRELOAD)
    cold = script.with_name("cold.py")
    cold.write_text(FIRST_LINE.replace("import time\n", f"import time\n{imports}", 1))
    seconds, cpu_s = [], []
    for _ in range(starts):
        began, reaped = time.time(), children_cpu_s()
        out = subprocess.run([*guard, sys.executable, "-u", str(cold)], capture_output=True, text=True, check=True)
        cpu_s.append(children_cpu_s() - reaped)  # (the guard's exec is the rank: one process)
        seconds.append(float(out.stdout.split()[0]) - began)
    return seconds, cpu_s


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starts", type=int, default=20)
    args = p.parse_args()
    guard = [sys.executable, "-m", "muster.worker.rank.orphan_guard", str(os.getpid())]
    with tempfile.TemporaryDirectory(prefix="muster-bench-rank-start-") as d:
        script = Path(d) / "first_line.py"
        script.write_text(FIRST_LINE)
        warm, warm_cpu = asyncio.run(warm_starts(script, guard, args.starts))
        cold, cold_cpu = cold_starts(script, guard, max(3, args.starts // 4))
    print(json.dumps({"benchmark": "rank_start", "preload": list(PRELOAD),
                      "warm_s": summary(warm), "cold_s": summary(cold),
                      "cold_over_warm_p50": round(summary(cold)["p50"] / summary(warm)["p50"], 1),
                      "life_cpu_s": {"warm": summary(warm_cpu), "cold": summary(cold_cpu)}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
