"""Text that others wrote (a rank's output, a Leave's reason, a phase, a host name), made safe for
an operator's terminal: C0 and C1 control characters and the bidi controls are escaped, so none can
retitle the window, clear the screen, move the cursor or reorder what follows (CVE-2021-25743 was
this in kubectl). What is printed for a program (`--json`) stays as it was; the coordinator refuses
these characters in reasons and phases (`CONTROL`), so only rank output and older records hold them."""

from __future__ import annotations

import re

# The bidi controls: marks (ALM, LRM, RLM), embeddings and overrides, isolates; and the line and
# paragraph separators, which some terminals take as a newline.
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
UNSAFE = re.compile(f"[\x00-\x08\x0a-\x1f\x7f-\x9f{_BIDI}]")  # a tab stays: rank output aligns columns with it
CONTROL = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}]")  # what a one-line label (a reason, a phase) may not hold


def escaped(text: str) -> str:
    """`text` with each unsafe character written as its escape (ESC as \\x1b, U+202E as \\u202e)."""
    return UNSAFE.sub(_escape, text)


def _escape(m: re.Match) -> str:
    c = ord(m[0])
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
