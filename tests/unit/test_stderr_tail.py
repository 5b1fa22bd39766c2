"""A rank's stderr passes through its agent's stderr in whole lines: a line the rank has not ended
yet never shares one with the agent's own log records, and one left without an end is still passed
on (a prompt, a progress bar)."""

import os
import time

import pytest

from muster.worker.agent.slot import PARTIAL_LINE_S, StderrTail

pytestmark = pytest.mark.timeout(30)


def test_a_rank_line_is_passed_on_whole_around_the_agents_own_records(capfd):
    read, write = os.pipe()
    tail = StderrTail(read)
    os.write(write, b"train.py: error: argument --lr")
    time.sleep(0.1)
    os.write(2, b"{\"event\": \"rank_started\"}\n")  # the agent's record, meanwhile
    os.write(write, b": invalid float value\nnext line\n")
    os.close(write)
    assert tail.lines(5, wait_s=5) == ("train.py: error: argument --lr: invalid float value", "next line")
    err = capfd.readouterr().err
    assert err == "{\"event\": \"rank_started\"}\ntrain.py: error: argument --lr: invalid float value\nnext line\n"


def test_a_line_left_without_its_end_is_passed_on_after_a_moment(capfd):
    read, write = os.pipe()
    tail = StderrTail(read)
    os.write(write, b"epoch 1: 40%\r")
    os.write(write, b"password: ")
    deadline = time.monotonic() + PARTIAL_LINE_S + 5
    seen = ""
    while "password: " not in seen and time.monotonic() < deadline:
        time.sleep(0.1)
        seen += capfd.readouterr().err
    assert seen == "epoch 1: 40%\rpassword: "
    os.close(write)
    tail.lines(1, wait_s=5)
