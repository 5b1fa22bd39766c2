"""What every verb's parser shares: one-line refusals with a suggestion, checked numbers and
durations, the coordinator, job, logging and client security flags, and where their defaults come from."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path


DEFAULT_ADDRESS = "127.0.0.1:7600"  # where `muster serve` listens, and where the other verbs look, by default


class OneLineParser(argparse.ArgumentParser):
    """Bad input is one line naming the flag, and exit status 2: not the usage, which buries it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}{self._suggestion(message)} (see {self.prog} --help)\n")

    def _suggestion(self, message: str) -> str:
        """'; did you mean X?' for a mistyped verb, choice or flag (`stauts`, `--nodse`)."""
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            word, known = found[1], re.findall(r"'([^']*)'", found[2])
        elif found := re.search(r"unrecognized arguments: (\S+)", message):
            word, known = found[1].split("=")[0], self._flags()
        else:
            return ""
        close = difflib.get_close_matches(word, known, n=1)
        return f"; did you mean {close[0]}?" if close else ""

    def parse_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def _flags(self) -> list[str]:
        """This parser's flags and, as an unknown flag is refused by the top parser, the given verb's."""
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                verb = next((action.choices[a] for a in getattr(self, "_given", ()) if a in action.choices), None)
                flags += verb._flags() if verb is not None else []
        return flags


def _checked(text: str, parse: Callable[[str], float], ok: Callable[[float], bool], what: str):
    """A flag's number, or argparse's one-line refusal naming what it must be."""
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def wait_seconds(text: str) -> float:
    """A bounded wait: 0 (none) to an hour."""
    return _checked(text, float, lambda v: 0 <= v <= 3600, "within 0 and 3600 seconds")


def refresh_interval(text: str) -> float:
    """--interval: a refresh loop that neither spins nor looks stuck."""
    return _checked(text, float, lambda v: 0.1 <= v <= 3600, "within 0.1 and 3600 seconds")


def duration(text: str) -> float:
    """Seconds from `90`, `90s`, `15m`, `12h` or `7d`."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
    try:
        seconds = float(number) * unit
    except ValueError:
        raise ValueError(f"{text!r} is no duration (e.g. 3600, 90s, 15m, 12h, 7d)") from None
    if not 0 <= seconds < 10**9:
        raise ValueError(f"duration {text!r} is out of range")
    return seconds


def coordinator_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", help=f"HOST:PORT[,HOST:PORT...] of any replicas (default $MUSTER_COORDINATOR, "
                                         f"else {DEFAULT_ADDRESS})")


def job_flag(p: argparse.ArgumentParser, required: bool, help: str, positional: bool = True) -> None:
    """The job: JOB, positional, with --job kept as an alias (every client verb names it the same way),
    else $MUSTER_JOB (checked after parsing: a job the environment supplies is not missing)."""
    if positional:
        p.add_argument("job", nargs="?", metavar="JOB", help=help)
        p.add_argument("--job", dest="job_option", metavar="JOB", help="the same as JOB")
    else:
        p.add_argument("--job", help=help)
    p.set_defaults(job_required=required)


def from_environment(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if "coordinator" in args:
        # where the address came from, for the hint when nothing answers there
        args.coordinator_from = ("--coordinator" if args.coordinator else "$MUSTER_COORDINATOR"
                                 if os.environ.get("MUSTER_COORDINATOR") else "the default")
        args.coordinator = args.coordinator or os.environ.get("MUSTER_COORDINATOR") or DEFAULT_ADDRESS
    if getattr(args, "job_option", None):
        if args.job and args.job != args.job_option:
            p.exit(2, f"muster {args.verb}: the job is named twice, {args.job!r} and --job {args.job_option!r}\n")
        args.job = args.job_option
    if "job" in args and args.job is None:
        args.job = os.environ.get("MUSTER_JOB") or None
        if args.job is None and getattr(args, "job_required", False):
            named = "--job JOB" if "job_option" not in args else "JOB"
            p.exit(2, f"muster {args.verb}: the job is required: muster {args.verb} {named} (or set MUSTER_JOB)\n")


def log_flags(p: argparse.ArgumentParser, default: bool) -> None:
    """The logging flags; after the verb they override only when given (SUPPRESS: no default)."""
    p.add_argument("--log-level", default="info" if default else argparse.SUPPRESS,
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-json", action="store_true", default=None if default else argparse.SUPPRESS,
                   help="JSON logs even on a terminal")


def client_security_flags(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", default=env("MUSTER_TOKEN", ""), help="the job's token (default $MUSTER_TOKEN); "
                       "on the command line every local user sees it in `ps`: prefer --token-file or $MUSTER_TOKEN")
    token.add_argument("--token-file", metavar="FILE",
                       help="a file holding the job's token (kept off the command line)")
    p.add_argument("--tls-ca", default=env("MUSTER_TLS_CA", ""), help="trust this CA for the coordinators' TLS "
                   "(default $MUSTER_TLS_CA)")
    p.add_argument("--tls-cert", default=env("MUSTER_TLS_CERT", ""), help="mTLS client certificate ($MUSTER_TLS_CERT)")
    p.add_argument("--tls-key", default=env("MUSTER_TLS_KEY", ""), help="its private key ($MUSTER_TLS_KEY)")


def tls_files(args: argparse.Namespace, ca: str, cert: str, key: str):
    """The TLS files three flags name (by their dests), checked: errors name the flags."""
    from muster.security import TlsFiles

    names = (ca, cert, key)
    return TlsFiles(*(getattr(args, n) or "" for n in names)).check(tuple("--" + n.replace("_", "-") for n in names))


def secret_file(path: str, flag: str) -> str:
    """A secret kept off the command line (which every local user reads in `ps`): a file's text."""
    try:
        secret = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from exc
    if not secret:
        raise ValueError(f"{flag} {path}: the file is empty")
    return secret


def security(args: argparse.Namespace):
    from muster.security import ClientSecurity

    token = secret_file(args.token_file, "--token-file") if args.token_file else args.token
    return ClientSecurity(token, tls_files(args, "tls_ca", "tls_cert", "tls_key"))
