"""structlog setup: JSON lines for services (not a terminal), readable output on a console."""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
from datetime import datetime
from pathlib import Path

import structlog

from muster import rank_logs

_copy: _JsonCopy | None = None


def configure(level: str = "info", *, json: bool | None = None, copy: bool = False) -> None:
    """Logs to stderr; with `copy`, each record also as a JSON line to the file `copy_to` names (what
    `muster logs` reads of an agent: `muster run --log-dir`)."""
    global _copy
    _copy = _JsonCopy() if copy else None
    if json is None:
        json = not sys.stderr.isatty()
    # A plain traceback on the console too: structlog's default there is rich's, with every frame's
    # locals, when rich is installed: 1.2 s and 360 KB for one exception in a deep stack, on the
    # leader's event loop (its other jobs' nodes looked silent meanwhile), and their values printed.
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if json else structlog.dev.set_exc_info,
            *([_copy] if _copy else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def copy_to(path: Path) -> None:
    """Where the copy goes from now on, the records so far first: an agent knows its log's place
    (its run's directory) only once it joined. Nothing without `configure(copy=True)` (an agent run
    in-process, as tests do, keeps its log on stderr)."""
    if _copy is not None:
        _copy.open(path)


class _JsonCopy:
    """A processor writing each record to a file as a JSON line, the console's own rendering aside;
    held in memory (the latest HELD) until the file is named."""

    HELD = 1000  # records before the Join: a few lines, or a --join-timeout of waiting notes

    def __init__(self):
        self.file = None
        self.held: collections.deque[str] = collections.deque(maxlen=self.HELD)
        self.render = structlog.processors.JSONRenderer()

    def open(self, path: Path) -> None:
        # a line at a time: `muster logs --follow` reads as it grows
        self.file = os.fdopen(rank_logs.open_log(path), "a", buffering=1)
        self.file.writelines(self.held)
        self.held.clear()

    def __call__(self, logger, name: str, event_dict: dict) -> dict:
        record = structlog.processors.format_exc_info(logger, name, dict(event_dict))  # a traceback as text
        line = self.render(logger, name, record) + "\n"
        if self.file is None:
            self.held.append(line)
        else:
            self.file.write(line)
        return event_dict


def as_text(line: str) -> str:
    """One record of an agent's log copy (a JSON line) as a person reads it: the time in the local
    zone with its offset, the level, the event, then the rest as key=value. Any other line as it is."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or "event" not in record:
        return line
    at, level, event = record.pop("timestamp", ""), record.pop("level", ""), record.pop("event")
    try:
        at = datetime.fromisoformat(at).astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
    except (TypeError, ValueError):
        pass  # (as written)
    rest = " ".join(f"{k}={v}" for k, v in record.items() if k != "exception")
    text = " ".join(part for part in (at, f"{level:<7}" if level else "", str(event), rest) if part)
    return text + ("\n" + record["exception"] if "exception" in record else "")
