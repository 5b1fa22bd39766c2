"""`muster logs`' file side: which files are whose, a bounded tail, following across a restart."""

import os
import stat

import pytest

from muster import rank_logs


def test_files_are_found_by_node_and_slot_exactly_oldest_start_first(tmp_path):
    for name in ("a-slot0-2.log", "a-slot0-10.log", "a-slot1-1.log", "a-b-slot0-1.log", "a-slot0-1.txt"):
        (tmp_path / name).write_text("x\n")
    found = rank_logs.starts(tmp_path, "a")
    assert {k: [s for s, _ in v] for k, v in found.items()} == {0: [2, 10], 1: [1]}
    assert list(rank_logs.starts(tmp_path, "a", 1)) == [1] and list(rank_logs.starts(tmp_path, "a-b")) == [0]


def test_a_tail_reads_from_the_end_in_blocks_and_leaves_a_partial_line_to_the_follower(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_logs, "BLOCK", 7)  # many blocks: lines cross their edges
    path = tmp_path / "a-slot0-1.log"
    path.write_text("".join(f"line {i}\n" for i in range(50)) + "partial")
    lines, offset = rank_logs.tail(path, 3)
    assert lines == ["line 47", "line 48", "line 49"] and offset == path.stat().st_size - len("partial")
    assert rank_logs.tail(path, 0) == ([], offset) and rank_logs.tail(path, 500)[0][0] == "line 0"


def test_a_follower_finishes_the_old_file_then_switches_to_the_restarted_slots_new_one(tmp_path):
    old = tmp_path / "a-slot0-1.log"
    old.write_text("one\ntw")
    follower = rank_logs.Follower("a", 0, old, 0)
    assert follower.read(tmp_path) == ["one"]
    with open(old, "a") as f:
        f.write("o\nlast words")
    (tmp_path / "a-slot0-2.log").write_text("again\n")
    assert follower.read(tmp_path) == ["two", "last words", "--- a slot 0 started again: a-slot0-2.log ---", "again"]
    assert follower.read(tmp_path) == []


def test_the_agents_own_log_is_followed_and_never_switched(tmp_path):
    agent = rank_logs.agent_log(tmp_path, "a")
    agent.write_text('{"event": "rank_started"}\n')
    (tmp_path / "a-slot0-1.log").write_text("rank\n")
    follower = rank_logs.Follower("a", None, agent, 0)
    assert follower.read(tmp_path) == ['{"event": "rank_started"}'] and follower.path == agent
    assert list(rank_logs.starts(tmp_path, "a")) == [0]  # not a slot's file


def test_a_runs_directory_and_its_files_are_the_agents_users_alone_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the most open a user could have set: the modes are the code's
    try:
        run = rank_logs.made_dir(tmp_path / "shared" / "logs", "job-a", 3)
        fd = rank_logs.open_log(rank_logs.slot_log(run, "n0", 0, 1))
        os.close(fd)
    finally:
        os.umask(old)
    assert run == tmp_path / "shared" / "logs" / "job-a" / "3"
    assert [stat.S_IMODE(p.stat().st_mode) for p in (run.parent.parent, run.parent, run)] == [0o700] * 3
    assert stat.S_IMODE((run / "n0-slot0-1.log").stat().st_mode) == 0o600
    assert rank_logs.made_dir(tmp_path / "shared" / "logs", "job-a", 3) == run  # made once, found after
    (run / "n0-agent.log").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):  # a link planted in its place is not written through
        rank_logs.open_log(rank_logs.agent_log(run, "n0"))
    assert not (tmp_path / "elsewhere").exists()
