"""Others' text on an operator's terminal: control characters and bidi controls escaped, the rest
(a tab, any script) as it was."""

import pytest

from muster.terminal import CONTROL, escaped


@pytest.mark.parametrize("raw,shown", [
    ("\x1b]0;owned\x07", "\\x1b]0;owned\\x07"),  # a window title (OSC), ended by BEL
    ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # clear the screen, cursor home
    ("\x9b31m", "\\x9b31m"),  # CSI as one C1 character
    ("a\rb\nc\x00\x7f", "a\\x0db\\x0ac\\x00\\x7f"),
    ("invoice\u202eexe.pdf", "invoice\\u202eexe.pdf"),  # the right-to-left override
    ("\u2066x\u2069 \u200e\u200f\u061c \u2028", "\\u2066x\\u2069 \\u200e\\u200f\\u061c \\u2028"),
])
def test_controls_and_bidi_overrides_are_escaped(raw, shown):
    assert escaped(raw) == shown and CONTROL.search(raw)


def test_tabs_and_every_script_are_kept():
    text = "loss\t0.25\tépoque 日本語 ← مرحبا"
    assert escaped(text) == text
    assert CONTROL.search("a\tb") and not CONTROL.search(text.replace("\t", " "))  # a label is one line: no tab


TRICK = "drained \x1b]0;owned\x07\x1b[2J\u202e"  # a reason a coordinator before this check kept


def test_events_jobs_and_status_lines_escape_it_and_json_keeps_it():
    import argparse
    import json

    from muster.cli import views
    from muster.json_output import as_json
    from muster.v1 import muster_pb2 as pb

    event = pb.Event(kind="node_left", nodes=["n0"], reason=TRICK, generation=2)
    line = views._event_line(event)
    assert line.endswith("drained \\x1b]0;owned\\x07\\x1b[2J\\u202e") and "\x1b" not in line
    assert json.loads(json.dumps(as_json(event)))["reason"] == TRICK
    response = pb.StatusResponse(jobs=[pb.JobStatus(name="j", run=1, outcome="stopped", outcome_reason=TRICK)])
    shown = views.status_view(argparse.Namespace(json=False, watch=False), "j", response)
    assert any("drained \\x1b]0;owned" in s for s in shown) and not any("\x1b" in s or "\u202e" in s for s in shown)
    (doc,) = views.status_view(argparse.Namespace(json=True, watch=True), "j", response)
    assert json.loads(doc)["jobs"][0]["outcome_reason"] == TRICK
