"""Console logging renders an exception as a plain traceback: structlog's default there (rich's,
when rich is installed) printed every frame's locals, 360 KB and 1.2 s for one exception on the
leader's event loop, and with them whatever values they held."""

import json
import stat
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import structlog
    from muster import logs
    logs.configure("info", json=False)

    def tally(depth, token):
        if depth == 0:
            raise RuntimeError("injected tally fault")
        tally(depth - 1, token)

    try:
        tally(10, "secret-token-0123456789")
    except RuntimeError:
        structlog.get_logger().exception("tally_failed")
""")


def test_a_console_exception_is_a_plain_traceback_without_locals():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "tally_failed" in out.stderr and "RuntimeError: injected tally fault" in out.stderr
    assert "secret-token" not in out.stderr and len(out.stderr) < 4000, out.stderr[:2000]


COPY = textwrap.dedent("""
    import sys, structlog
    from pathlib import Path
    from muster import logs
    logs.configure("info", json=True, copy=True)
    structlog.get_logger().info("before_join")  # held: the run, and so the file, is not known yet
    assert not Path(sys.argv[1]).exists()
    logs.copy_to(Path(sys.argv[1]))
    structlog.get_logger().info("after_join")
""")


def test_an_agents_log_copy_is_held_until_its_file_is_named_then_written_0600(tmp_path):
    path = tmp_path / "n0-agent.log"
    out = subprocess.run([sys.executable, "-c", COPY, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["before_join", "after_join"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_agents_record_reads_as_text_with_its_zone_and_other_lines_as_they_are():
    from datetime import datetime

    from muster.logs import as_text

    line = json.dumps({"event": "rank_started", "level": "info", "timestamp": "2026-11-29T12:00:00.5Z", "slot": 1})
    local = datetime.fromisoformat("2026-11-29T12:00:00.5Z").astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
    assert as_text(line) == f"{local} info    rank_started slot=1"
    assert as_text("a rank's own output {not json") == "a rank's own output {not json"
    assert as_text("[1, 2]") == "[1, 2]"
