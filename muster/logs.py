"""structlog setup: JSON lines for services (not a terminal), readable output on a console."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog


def configure(level: str = "info", *, json: bool | None = None, copy_to: Path | None = None) -> None:
    """Logs to stderr; with `copy_to`, each record also as a JSON line to that file (what `muster
    logs` reads of an agent: `muster run --log-dir`)."""
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
            *([_JsonCopy(copy_to)] if copy_to else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


class _JsonCopy:
    """A processor writing each record to a file as a JSON line, the console's own rendering aside."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)  # a line at a time: `muster logs --follow` reads as it grows
        self.render = structlog.processors.JSONRenderer()

    def __call__(self, logger, name: str, event_dict: dict) -> dict:
        record = structlog.processors.format_exc_info(logger, name, dict(event_dict))  # a traceback as text
        self.file.write(self.render(logger, name, record) + "\n")
        return event_dict
