"""The docs that must not drift are generated from what they describe, and committed, so that they
read the same on the repository's web view as in the built site (`make docs-gen` writes them;
`make docs` and a test check that they are current):

- `reference/cli.md`: from the argparse parsers (`muster.cli.parser()`), every subcommand and flag;
- `reference/wire.md`: from `protos/muster/v1/*.proto` (protoc's descriptors, comments included);
- the block after each marker `<!-- muster:NAME ARG -->` in a page, up to `<!-- /muster -->`: the
  exit status table (`src/muster/worker/outcome.py`), the metrics (`src/muster/coordinator/metrics.py`), the --json
  schema (`reference/json-schema.json`, which the tests validate every verb's output against), and
  the benchmark tables built from `bench/results/*.json`, so a benchmark run updates the
  performance page, not prose, and the suite's slowest tests (`tests/durations.json`).

An unknown marker, a missing results file or a results file the performance page does not show
is an error. Usage: `python docs/generate.py [--check]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
PROTOS = ROOT / "protos"
END = "<!-- /muster -->"
# A marker, and the block generated after it last time (none yet on a new marker): the block may not
# hold another marker, so a new marker never swallows the next one's block.
# An inline figure: `<!-- muster:fig FILE.json:dotted.path -->VALUE<!-- /muster -->` within a sentence.
FIGURE = re.compile(r"<!-- muster:fig ([^ ]+) -->(?:[^<\n]*" + re.escape(END) + ")?")
MARKER = re.compile(r"<!-- muster:(?!fig )([a-z-]+)(?: ([^ ]+))? -->(?:\n(?:(?!<!-- muster:).)*?" + re.escape(END) + ")?",
                    re.DOTALL)


class GenerationError(Exception):
    """What the docs name that does not exist (a results file, a marker)."""


# --- the pages --------------------------------------------------------------------------------------


def generated() -> dict[Path, str]:
    """Every generated file's path and its content now."""
    pages = {DOCS / "reference/cli.md": cli_page(), DOCS / "reference/wire.md": wire_page()}
    for page in sorted([ROOT / "README.md", *DOCS.rglob("*.md")]):
        if page in pages:
            continue
        text = page.read_text()
        if MARKER.search(text) or FIGURE.search(text):
            pages[page] = expand(text, page.relative_to(ROOT))
    return pages


def expand(markdown: str, where: Path) -> str:
    shown = {arg.split(":")[0] for name, arg in MARKER.findall(markdown) if name == "bench" and arg}

    def block(match: re.Match) -> str:
        name, arg = match.group(1), match.group(2)
        if name == "exit-status":
            body = exit_status()
        elif name == "metrics":
            body = metrics_table()
        elif name == "json-schema":
            body = "```json\n" + (DOCS / "reference" / "json-schema.json").read_text() + "```"
        elif name == "bench":
            body = bench_section(arg)
        elif name == "bench-others":
            body = bench_others(shown)
        elif name == "modules":
            body = module_map()
        elif name == "faults":
            body = fault_table(arg, where)
        elif name == "slowest-tests":
            body = slowest_tests()
        else:
            raise GenerationError(f"{where}: unknown marker muster:{name}")
        return f"<!-- muster:{name}{' ' + arg if arg else ''} -->\n{body.rstrip()}\n{END}"

    return MARKER.sub(block, FIGURE.sub(lambda m: f"<!-- muster:fig {m[1]} -->{figure(m[1])}{END}", markdown))


def figure(arg: str) -> str:
    """One figure of a results file, `FILE.json:key.0.key` (list items by index), as `num` writes it."""
    name, _, path = arg.partition(":")
    value = load(name)
    for key in path.split(".") if path else ():
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError):
            raise GenerationError(f"bench/results/{name} has no {path!r} (at {key!r})") from None
    if isinstance(value, (dict, list)):
        raise GenerationError(f"bench/results/{name}: {path!r} is not a figure")
    return num(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the generated docs (or, with --check, say which are stale).")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is not current")
    args = p.parse_args(argv)
    try:
        pages = generated()
    except GenerationError as exc:
        print(f"docs: {exc}", file=sys.stderr)
        return 2
    stale = [path for path, text in pages.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"docs: {path.relative_to(ROOT)} is stale: run `make docs-gen` and commit it", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path])
        print(f"docs: wrote {path.relative_to(ROOT)}")
    return 0


# --- helpers ---------------------------------------------------------------------------------------


def cell(text) -> str:
    """Text fit for a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def plain_environment():
    """The parsers read defaults such as $MUSTER_TOKEN: build them without the builder's secrets,
    and at a fixed width so `usage:` lines do not depend on the terminal."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MUSTER_")}
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        yield
    finally:
        os.environ.update(saved)
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


# --- the module map ---------------------------------------------------------------------------------

PACKAGE = ROOT / "src" / "muster"


# The processes a module runs in: each entry point's module-level imports, followed transitively
# (imports inside functions are loaded only when called: `muster serve` is the CLI's process too, but
# its replica is entered by `service`, named here as a process of its own).
PROCESSES = {"replica": ["muster.coordinator.edges.service"], "agent": ["muster.worker.agent.agent"],
             "rank": ["muster.worker.rank.runner", "muster.worker.rank.zygote", "muster.worker.rank.orphan_guard"],
             "torchrun": ["muster.worker.torchrun.rendezvous"],
             "training": ["muster.worker.library.api", "muster.worker.integrations.hf",
                          "muster.worker.integrations.lightning", "muster.worker.integrations.accelerate"],
             "CLI": ["muster.cli"]}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree, module: str, known: set[str], top_only: bool) -> set[str]:
    """The package's modules that `tree` imports (`from muster.x import y` names module x.y where it is one)."""
    import ast

    nodes = tree.body if top_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} & known
            found |= {f"{node.module}.{a.name}" for a in node.names} & known
    return found - {module}


def module_map() -> str:
    """Every module of the packages, with the first sentence of its docstring, the processes it runs
    in and the test files that import it: the map cannot miss a module or say what its docstring no
    longer says."""
    import ast

    paths = sorted(p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts)
    trees = {_module_name(p): ast.parse(p.read_text()) for p in paths}
    known = set(trees)
    imports = {m: _imports(t, m, known, top_only=True) for m, t in trees.items()}
    runs_in: dict[str, list[str]] = {m: [] for m in known}
    for process, entries in PROCESSES.items():
        todo, seen = [e for e in entries if e in known], set()
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += [i for i in imports[m] if i not in seen]
                todo += [p for p in known if m.startswith(p + ".")]  # a module's packages run their __init__
        for m in seen:
            runs_in[m].append(process)
    tested: dict[str, list[str]] = {m: [] for m in known}
    for test in sorted((ROOT / "tests").rglob("test_*.py")):
        for m in _imports(ast.parse(test.read_text()), "", known, top_only=False):
            tested[m].append(test.stem.removeprefix("test_"))
    rows = []
    for path in paths:
        if path.name.startswith("__"):
            continue
        name, where = _module_name(path), path.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(trees[name])
        if not doc:
            raise GenerationError(f"{where} has no module docstring (the design page's map needs one)")
        first = " ".join(doc.split("\n\n")[0].split())
        sentence = re.match(r"(.+?\.)(\s|$)", first)
        said = sentence[1] if sentence else first
        tests = tested[name]
        rows.append([f"`{where}`", said if len(said) <= 240 else said[:239].rsplit(" ", 1)[0] + " …",
                     ", ".join(runs_in[name]) or "—",
                     (", ".join(tests[:3]) + (f" +{len(tests) - 3}" if len(tests) > 3 else "")) or "—"])
    return table(["module", "what it is (its docstring's first sentence)", "runs in", "tested in (test_…)"], rows)


def fault_table(tables: str | None, where: Path) -> str:
    """The chaos faults of `tables` (comma-separated: single, partition, compound), from the
    records the chaos suite injects (tests/chaos/faults.py): a new fault kind is a new row."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_faults", ROOT / "tests" / "chaos" / "faults.py")
    faults = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (a dataclass looks itself up there)
    spec.loader.exec_module(faults)
    names = (tables or "").split(",")
    unknown = set(names) - {k.table for k in faults.KINDS}
    if unknown:
        raise GenerationError(f"{where}: muster:faults names no fault table {sorted(unknown)}")
    return faults.markdown(*names)


DURATIONS = ROOT / "tests" / "durations.json"


def slowest_tests(top: int = 10) -> str:
    """The suite's `top` slowest tests and what each tier took, from tests/durations.json (written
    by `make durations` from the JUnit XML of the last `make test`)."""
    if not DURATIONS.is_file():
        raise GenerationError("tests/durations.json is missing (a marker names it): run `make test` then `make durations`")
    d = json.loads(DURATIONS.read_text())
    m = d.get("machine", {})
    load = m.get("loadavg_at_start", "").split()
    counts = ", ".join(f"{n} {outcome}" for outcome, n in d["tests"].items())
    tiers = ", ".join(f"{tier} {num(secs)} s" for tier, secs in d["tiers_s"].items())
    args = " ".join(a for a in m.get("args", "").split() if not a.startswith("--junitxml"))
    minutes, seconds = divmod(round(d["wall_s"]), 60)
    cpu = "cpu_seconds" in d
    rows = [[i, f"`{t['test'].split('::')[0]}`", cell(t["test"].split("::", 1)[1]),
             num(t["s"]) + ("" if t["outcome"] == "passed" else f" ({t['outcome']})"),
             *([num(t["cpu_s"]) if "cpu_s" in t else "?"] if cpu else [])]
            for i, t in enumerate(d["slowest"][:top], 1)]
    cpu_tiers = ", ".join(f"{tier} {num(secs)} s" for tier, secs in d.get("tiers_cpu_s", {}).items())
    return (table(["#", "file", "test", "seconds", *(["CPU seconds"] if cpu else [])], rows) +
            f"\n*From `tests/durations.json`: " + (f"`pytest {args}` " if args else "") +
            f"({d['timestamp'][:16].replace('T', ' ')} UTC), {counts} in {minutes} min {seconds} s"
            + (f" on {m['workers']} workers, {m['cpus']} CPUs" if "workers" in m and "cpus" in m else "")
            + (f", load average {load[0]} at its start" if load else "") +
            f"; the tests' own seconds, setup and teardown included: {tiers}."
            + (f" The CPU seconds of their processes: {num(d['cpu_seconds'])} in all ({cpu_tiers})" if cpu else "")
            + (f", of which the test processes' own (their waits, their log reads) {num(d['harness_cpu_seconds'])} s"
               if cpu and "harness_cpu_seconds" in d else "") + ("." if cpu else "")
            + (f" {d['note']}" if d.get("note") else "") + "*\n")


# --- the CLI reference -----------------------------------------------------------------------------


def cli_page() -> str:
    from muster import cli

    with plain_environment():
        root = cli.parser()
        sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        out = [
            "# CLI reference\n",
            "Generated by `make docs-gen` from the argparse parsers in `src/muster/cli/` "
            "(`muster.cli.parser()`), so it says what `muster COMMAND --help` says. "
            "Flags of the client commands that read an environment variable are shown with it, "
            "never with the builder's value.\n",
            "## muster\n",
            *parser_section(root, skip=sub),
            "Commands:\n",
            table(["command", "what it does"],
                  [[f"[`{name}`](#muster-{slugify(name, '-')})", helps.get(name, "")] for name in sub.choices]),
        ]
        for name, sp in sub.choices.items():
            out += [f"## muster {name}\n", f"{cell(helps.get(name, ''))}\n", *parser_section(sp)]
    return "\n".join(out)


def parser_section(p: argparse.ArgumentParser, skip=None) -> list[str]:
    out = ["```text\n" + p.format_usage().strip() + "\n```\n"]
    raw = issubclass(p.formatter_class, argparse.RawDescriptionHelpFormatter)
    if p.description and p.prog != "muster":
        out.append(("```text\n" + p.description.strip() + "\n```\n") if raw else f"{cell(p.description)}\n")
    for group in p._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction) and a is not skip]
        if not actions:
            continue
        title = group.title or "options"
        out.append(f"**{title}**\n")
        out.append(table(["flag", "default", "description"], [option_row(p, a) for a in actions]))
        if group.description:
            out.append(f"{cell(group.description)}\n")
    exclusive = [" and ".join(f"`{a.option_strings[0]}`" for a in g._group_actions) for g in p._mutually_exclusive_groups]
    if exclusive:
        out.append("Either, not both: " + "; ".join(exclusive) + ".\n")
    if p.epilog:
        out.append("```text\n" + p.epilog.strip() + "\n```\n")
        if "exit status" in p.epilog:
            out.append("See [Exit codes](exit-codes.md).\n")
    return out


def option_row(p: argparse.ArgumentParser, a: argparse.Action) -> list[str]:
    if a.option_strings:
        takes_value = a.nargs != 0
        value = ""
        if takes_value:
            value = a.metavar or ("{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper())
        flag = ", ".join(f"`{o}{' ' + value if value else ''}`" for o in a.option_strings)
    else:
        flag = f"`{a.metavar or a.dest}`" + (" ..." if a.nargs == argparse.REMAINDER else "")
    if a.required:
        default = "required"
    elif not a.option_strings or a.nargs == 0 or a.default in (None, "", argparse.SUPPRESS):
        default = ""
    else:
        default = f"`{a.default}`"
    text = a.help or ""
    if "%" in text:
        params = {k: v for k, v in vars(a).items() if v is not argparse.SUPPRESS}
        params["prog"] = p.prog
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        text = text % params
    return [flag, default, text]


# --- the wire contract -----------------------------------------------------------------------------


def wire_page() -> str:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    import grpc_tools

    sources = sorted(PROTOS.glob("muster/*/*.proto"))
    if not sources:
        raise GenerationError("no .proto files under protos/muster/")
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "descriptors.pb"
        args = ["protoc", f"-I{PROTOS}", f"-I{include}", "--include_source_info",
                f"--descriptor_set_out={target}", *map(str, sources)]
        if protoc.main(args) != 0:
            raise GenerationError(f"protoc failed on {', '.join(map(str, sources))}")
        descriptors = descriptor_pb2.FileDescriptorSet.FromString(target.read_bytes())
    out = [
        "# Wire contract\n",
        "Generated by `make docs-gen` from " + ", ".join(f"`{s.relative_to(ROOT)}`" for s in sources)
        + " (protoc's descriptors, with the comments of the file). The Python stubs beside them are "
        "checked in; `make protos` regenerates them and a test fails when they are stale.\n",
    ]
    for fd in descriptors.file:
        out += ProtoPage(fd).render()
    return "\n".join(out)


class ProtoPage:
    """One .proto file's section of the wire page: its services, then its messages and enums in
    the file's order, each with the comments written beside it."""

    def __init__(self, fd):
        self.fd = fd
        self.comments = {tuple(loc.path): loc for loc in fd.source_code_info.location}
        self.source = (PROTOS / fd.name).read_text().splitlines()
        self.maps = {}  # ".pkg.Msg.FooEntry" -> (key field, value field)
        self._collect_maps(f".{fd.package}", fd.message_type)
        self.out: list[str] = []

    def _collect_maps(self, prefix, messages) -> None:
        for m in messages:
            if m.options.map_entry:
                key, value = m.field
                self.maps[f"{prefix}.{m.name}"] = (key, value)
            self._collect_maps(f"{prefix}.{m.name}", m.nested_type)

    def said(self, path) -> str:
        """The comment lines above an element at its own indentation, then the comment after it on
        its line with the lines continuing it in the same column. (protoc gives a continued
        trailing comment's second line to the next field as its leading comment.)"""
        loc = self.comments.get(tuple(path))
        if loc is None:
            return ""
        line, column = loc.span[0], loc.span[1]
        above = []
        for text in reversed(self.source[:line]):
            if not text.strip().startswith("//") or text.index("//") != column:
                break
            above.insert(0, text.strip()[2:].strip())
        after = []
        end = loc.span[2] if len(loc.span) == 4 else line
        if "//" in self.source[end] and loc.path[-2:-1] == [2] and len(loc.path) > 2:
            at = self.source[end].index("//")
            after.append(self.source[end][at + 2:].strip())
            for text in self.source[end + 1:]:
                if not text.strip().startswith("//") or text.index("//") != at:
                    break
                after.append(text.strip()[2:].strip())
        return "\n".join(above + after)

    @staticmethod
    def paragraph(text: str) -> str:
        return "\n".join(line.strip() for line in text.splitlines()) + "\n" if text else ""

    def link(self, type_name: str) -> str:
        short = type_name.removeprefix(f".{self.fd.package}.")
        return f"[{short}](#{slugify(short, '-')})"

    def type_of(self, f) -> str:
        from google.protobuf.descriptor_pb2 import FieldDescriptorProto as F

        if f.type_name in self.maps:
            key, value = self.maps[f.type_name]
            return f"map<{self.type_of(key)}, {self.type_of(value)}>"
        if f.type in (F.TYPE_MESSAGE, F.TYPE_ENUM):
            name = self.link(f.type_name)
        else:
            name = F.Type.Name(f.type).removeprefix("TYPE_").lower()
        if f.label == F.LABEL_REPEATED:
            return f"repeated {name}"
        return ("optional " if f.proto3_optional else "") + name

    def render(self) -> list[str]:
        fd, header = self.fd, self.comments.get((12,))
        self.out = [f"From `protos/{fd.name}`, package `{fd.package}`:\n",
                    self.paragraph(header.leading_comments.strip() if header else ""), "## Services\n"]
        for si, service in enumerate(fd.service):
            self.service([6, si], service)
        self.out += ["## Messages and enums\n", "In the order of the file.\n"]
        # Messages and enums in the file's order: by the line each starts at.
        items = [(self._line((4, i), i), "m", i, m) for i, m in enumerate(fd.message_type)]
        items += [(self._line((5, i), i), "e", i, e) for i, e in enumerate(fd.enum_type)]
        for _, kind, i, item in sorted(items, key=lambda t: t[0]):
            if kind == "m":
                self.message([4, i], item, "")
            else:
                self.enum([5, i], item, "")
        return self.out

    def _line(self, path: tuple, default: int) -> int:
        return self.comments[path].span[0] if path in self.comments else default

    def service(self, path, service) -> None:
        self.out.append(f"### service {service.name}\n")
        self.out.append(self.paragraph(self.said(path)))
        rows = []
        for mi, m in enumerate(service.method):
            stream_in = "stream " if m.client_streaming else ""
            stream_out = "stream " if m.server_streaming else ""
            rows.append([f"`{m.name}`", f"{stream_in}{self.link(m.input_type)}",
                         f"{stream_out}{self.link(m.output_type)}", self.said(path + [2, mi])])
        self.out.append(table(["RPC", "request", "response", "what it does"], rows))

    def message(self, path, m, prefix) -> None:
        if m.options.map_entry:
            return
        name = f"{prefix}{m.name}"
        self.out.append(f"### {name}\n")
        self.out.append(self.paragraph(self.said(path)))
        if m.field:
            rows = []
            for fi, f in enumerate(m.field):
                oneof = ""
                if f.HasField("oneof_index") and not f.proto3_optional:
                    oneof = f"(one of `{m.oneof_decl[f.oneof_index].name}`) "
                rows.append([f"`{f.name}`", f.number, self.type_of(f), oneof + self.said(path + [2, fi])])
            self.out.append(table(["field", "#", "type", "meaning"], rows))
        else:
            self.out.append("No fields.\n")
        for ei, e in enumerate(m.enum_type):
            self.enum(path + [4, ei], e, f"{name}.")
        for ni, nested in enumerate(m.nested_type):
            self.message(path + [3, ni], nested, f"{name}.")

    def enum(self, path, e, prefix) -> None:
        self.out.append(f"### {prefix}{e.name}\n")
        self.out.append(self.paragraph(self.said(path)))
        self.out.append(table(["value", "#", "meaning"],
                              [[f"`{v.name}`", v.number, self.said(path + [2, vi])] for vi, v in enumerate(e.value)]))


# --- exit status and metrics -------------------------------------------------------------------------


def exit_status() -> str:
    from muster.worker import outcome

    rows = [[f"`{code}`", f"`{name}`"] for name, code in outcome.OUTCOMES.items()]
    return (
        "The outcome of a run and the exit status it gives (`muster.worker.outcome.OUTCOMES`):\n\n"
        + table(["exit status", "outcome"], rows)
        + "\nAs `muster run --help` prints it (`EXIT_STATUS_HELP`):\n\n```text\n"
        + outcome.EXIT_STATUS_HELP.strip() + "\n```\n"
    )


def metrics_table() -> str:
    from prometheus_client import metrics as pm

    from muster.coordinator.metrics import JobGauges, Metrics

    m = Metrics()
    m.watch(lambda: [JobGauges("JOB", True)], lambda: True)
    for value in vars(m).values():  # one labelled child each, so every family shows its labels
        if isinstance(value, pm.MetricWrapperBase) and value._labelnames:
            value.labels(**{name: name.upper() for name in value._labelnames})
    suffix = {"counter": "_total", "histogram": "_bucket, _sum, _count", "gauge": ""}
    rows = []
    for family in m.registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        exposed = f"{family.name}{suffix.get(family.type, '')}" if family.type != "histogram" else (
            f"{family.name}_bucket/_sum/_count")
        rows.append([f"`{exposed}`", family.type, ", ".join(f"`{label}`" for label in labels), family.documentation])
    return table(["metric", "type", "labels", "meaning"], rows)


# --- benchmarks --------------------------------------------------------------------------------------


def load(name: str) -> dict:
    path = RESULTS / name
    if not path.is_file():
        raise GenerationError(f"bench/results/{name} is missing (a marker names it)")
    return json.loads(path.read_text())


def num(x, digits: int = 3) -> str:
    """A figure with `digits` significant digits at most, thousands separated."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    from math import floor, log10

    places = max(0, digits - 1 - floor(log10(abs(x))))
    text = f"{x:,.{places}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def s(x) -> str:
    return f"{num(x)} s"


def ms(x) -> str:
    return "–" if x is None else f"{num(x)} ms"


def host(d: dict) -> str:
    h = d.get("host")
    if not h:
        return d.get("platform", "")  # (gpu_check.py's: the card, torch, CUDA and NCCL)
    load_avg = h.get("loadavg_at_start")
    return f"{h.get('cpus', '?')} CPUs" + (f", load average {num(load_avg[0], 2)} at its start" if load_avg else "")


def source(name: str, d: dict) -> str:
    where = host(d)
    return f"*From `bench/results/{name}`" + (f" ({where})" if where else "") + ".*\n"


def bench_section(arg: str | None) -> str:
    """`NAME.json`, or `NAME.json:PART` for one part of a file with several (capacity's
    `heartbeat` and `membership`)."""
    if not arg:
        raise GenerationError("muster:bench needs a file name")
    name, _, part = arg.partition(":")
    d = load(name)
    if part:
        if part not in d:
            raise GenerationError(f"bench/results/{name} has no part {part!r}")
        d = {k: v for k, v in d.items() if k in (part, "host") or not isinstance(v, (dict, list))}
    kind = d.get("benchmark")
    render = {
        "side_by_side": render_side_by_side,
        "recovery": render_recovery,
        "capacity": render_capacity,
        "scale": render_scale,
        "grpc_floor": render_grpc_floor,
        "rank_start": render_rank_start,
        "churn": render_churn,
        "abuse": render_abuse,
        "bench_check": render_bench_check,
        "death_heard": render_death_heard,
    }.get(kind, render_generic)
    return render(d) + "\n" + source(name, d)


def bench_others(shown: set[str]) -> str:
    """Every results file the page shows no section of, in a generic form: a new benchmark's
    results appear on the page without anyone writing its table first."""
    others = sorted(p.name for p in RESULTS.glob("*.json") if p.name not in shown)
    if not others:
        return "Every file in `bench/results/` has its section above.\n"
    out = []
    for name in others:
        d = json.loads((RESULTS / name).read_text())
        out.append(f"### {name}\n\n" + render_generic(d) + "\n" + source(name, d))
    return "\n".join(out)


def render_generic(d: dict) -> str:
    rows = []

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                if k not in ("host", "all") and not k.endswith("definition") and k != "note":
                    walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) < 60):
            rows.append([f"`{prefix}`", num(value) if not isinstance(value, str) else value])

    walk("", d)
    return table(["figure", "value"], rows[:60])


def render_side_by_side(d: dict) -> str:
    out = []
    if d.get("runs"):
        rows = []
        for r in d["runs"]:
            m, t = r["muster"], r["torchrun"]
            mk, tk = m["kill_to_step_s"], t["kill_to_step_s"]
            rows.append([
                r["ranks"], f"{s(mk['p50'])} ({num(mk['max'])})", f"{s(tk['p50'])} ({num(tk['max'])})",
                f"{num(tk['p50'] / mk['p50'], 2)}×", f"{m['steps_lost']['total']} / {t['steps_lost']['total']}",
                f"1 / {num(sum(t['workers_restarted']['per_kill']) / len(t['workers_restarted']['per_kill']), 2)}",
                s(m["detection_s"]["p50"]), s(t["phases_s"]["worker_start"]["p50"]),
            ])
        kills = len(d["runs"][0]["muster"]["kill_to_step_s"].get("all", [])) or "?"
        out.append(table(
            ["ranks", "kill → every rank stepping: Muster p50 (max)", "torchrun p50 (max)", "torchrun / Muster",
             f"completed steps redone, {kills} kills: Muster / torchrun", "processes restarted per kill",
             "Muster: kill → leader's decision p50", "torchrun: starting the workers p50"], rows))
    for u in d.get("unmodified", []):
        names = {"torchrun": "`torchrun --rdzv-backend c10d`", "muster-run": "`muster run -- torchrun …` (warm starts)",
                 "muster-run-cold": "`muster run --no-warm-start -- torchrun …`",
                 "muster-rdzv": "`torchrun --rdzv-backend=muster`"}
        base = u["torchrun"]["kill_to_step_s"]["p50"]
        rows = []
        for key, label in names.items():
            if key not in u:
                continue
            r = u[key]
            k = r["kill_to_step_s"]
            per_kill = r["workers_restarted"]["per_kill"]
            rows.append([label, s(r["start_to_step_s"]), f"{s(k['p50'])} ({num(k['max'])})",
                         f"{num(base / k['p50'])}×", r["steps_lost"]["total"],
                         num(sum(per_kill) / len(per_kill), 2), sum(r.get("restart_rounds", []))])
        script = {"plain": "`examples/train_plain.py`", "trainer": "`examples/train_trainer.py` (Hugging Face Trainer)"}
        out.append(f"{u['nodes']} nodes × {u['ranks'] // u['nodes']} ranks, {script[u.get('script', 'plain')]}:\n\n" + table(
            ["launcher", "start → every rank's first step", "kill → every rank stepping p50 (max)", "torchrun / it",
             "completed steps redone", "workers restarted per kill", "restart rounds in all"], rows))
    return "\n".join(out)


def render_recovery(d: dict) -> str:
    rows = []
    for r in d["runs"]:
        k, h, f = r["kill"], r.get("hang"), r.get("failover")
        model = r.get("model", "tiny")
        n = f"{r['ranks']}" + (f" ({model} parameters, Adam)" if model != "tiny" else "")
        rows += [
            [f"kill -9 one rank of {n} → every survivor completed a step in the new group",
             f"p50 {s(k['kill_to_step_s']['p50'])}, p99 {s(k['kill_to_step_s']['p99'])}"],
            ["kill → the leader's decision (detection)", f"p50 {s(k['detection_s']['p50'])}"],
        ]
        if h:
            rows += [[f"SIGSTOP one rank of {n} (a hang) → survivors stepping",
                      f"p50 {s(h['hang_to_step_s']['p50'])}, p99 {s(h['hang_to_step_s']['p99'])}"],
                     ["hang → the leader's decision", f"p50 {s(h['detection_s']['p50'])}"]]
        faults = [x for x in (k, h) if x]
        rows += [["completed steps lost / survivors lost / healthy ranks evicted",
                  f"{sum(x['steps_lost']['total'] for x in faults)} / {sum(x['survivors_lost'] for x in faults)}"
                  f" / {sum(x.get('healthy_evictions', 0) for x in faults)}"],
                 ["replacement started → its first step in the group" + (" (kill / hang)" if h else ""),
                  f"p50 {s(k['rejoin_s']['p50'])}" + (f" / {s(h['rejoin_s']['p50'])}" if h else "")]]
        rows += state_rows(r)
        if f:
            rows.append([f"SIGKILL the coordinator leader ({f['kills']}×) → standby serving",
                         f"p50 {s(f['standby_serves_s']['p50'])}; {f['steps_discarded']} steps discarded, "
                         f"{f['evictions']} evictions, {f['generation_changes']} generation changes"])
    api = d.get("step_api")
    if api:
        rows.append(["per-step cost of `step_scope` on the training thread", f"{num(api['median_us'])} µs median"])
    return table(["what", "measured"], rows) + "".join(reform_phases(r) + outside_timeline(r) for r in d["runs"])


def outside_timeline(run: dict) -> str:
    """A kill's reform from outside the ranks (`kill.timeline`): seconds from the kill on one clock,
    p50 / max over the kills."""
    timeline = run.get("kill", {}).get("timeline")
    if not timeline:
        return ""
    model = run.get("model", "tiny")
    rows = [[f"`{name}`", f"{s(v['p50'])} / {s(v['max'])}"] for name, v in timeline.items()]
    return (f"\nThe kill's reform from outside the ranks at {run['ranks']} ranks"
            + (f" ({model})" if model != "tiny" else "") + " (its moments in seconds after the kill, then the spans "
            "between them), p50 / max:\n\n"
            + table(["moment / span", "after a kill"], rows))


def state_rows(run: dict) -> list[list]:
    """What the state's movement cost at a kill: the survivors' (nothing, where they agree) and the
    replacement's, beside a raw broadcast of the same bytes."""
    k, rows = run["kill"], []
    if "steady_step_s" in run:
        rows.append(["a steady step / kill → step less one steady step (the reform's own cost)",
                     f"{s(run['steady_step_s'])} / {s(k.get('reform_cost_s', 0))}"])
    state = k.get("state") or {}
    if "survivor_received_bytes" in state:
        rows.append(["state each survivor sent / received at the kill's reform (p50, bytes)",
                     f"{num(state['survivor_sent_bytes']['p50'])} / {num(state['survivor_received_bytes']['p50'])}"])
    if "state_rate_mib_s" in state:
        raw = run.get("raw_broadcast", {}).get("mib_s")
        rows.append(["the replacement's state: MiB received in s, rate (a raw broadcast of the same bytes)",
                     f"{num(state['replacement_received_bytes']['p50'] / 2**20)} MiB in "
                     f"{s(state['replacement_transfer_s']['p50'])}, {num(state['state_rate_mib_s']['p50'])} MiB/s"
                     + (f" ({num(raw)} MiB/s, {num(100 * state['state_rate_mib_s']['p50'] / raw, 2)}%)" if raw else "")])
    return rows


def reform_phases(run: dict) -> str:
    """Where a survivor's reform went (its `group_formed` record), p50 / max over survivors and faults."""
    faults = [f for f in ("kill", "hang") if run.get(f, {}).get("phases")]
    if not faults:
        return ""
    names = list(run[faults[0]]["phases"])
    rows = [[f"`{name}`", *(f"{s(run[f]['phases'][name]['p50'])} / {s(run[f]['phases'][name]['max'])}"
                            if name in run[f]["phases"] else "-" for f in faults)] for name in names]
    model = run.get("model", "tiny")
    return (f"\nWhere a survivor's reform went at {run['ranks']} ranks"
            + (f" ({model})" if model != "tiny" else "") + ", p50 / max:\n\n"
            + table(["phase", *(f"after a {f}" for f in faults)], rows))


def render_capacity(d: dict) -> str:
    out = []
    hb = d.get("heartbeat")
    if hb:
        rows = []
        for p in hb["points"]:
            lat = p["frame_latency_ms"]
            relays = p["relay_cpu_cores"]
            rows.append([
                p["relays"] or "direct", f"{p['nodes']:,}", num(p["frames_per_s_per_node"]),
                num(p["delivered_frames_per_s"], 4), f"{num(lat['p50'])} / {num(lat['p99'])}",
                num(p["leader_cpu_cores"]), num(p["leader_frame_cpu_us_per_node_frame"]),
                num(p["leader_loop_us_per_node_frame"]), ", ".join(num(c) for c in relays) or "–",
                num(p["client_cpu_cores"]), s(p["change"]["decided_after_silence_s"]),
                s(p["change"]["every_node_held_it_after_s"]), p["evictions"],
            ])
        out.append(f"Heartbeat timeout {num(hb['heartbeat_timeout_s'])} s; windows of {num(hb['window_s'])} s; "
                   f"nodes simulated by {hb['client_processes']} processes ({cell(hb['clients'])}).\n")
        out.append(table(
            ["relays", "nodes", "frames/s per node", "delivered frames/s", "frame → leader p50 / p99 (ms)",
             "leader cores", "leader µs CPU per node frame", "…of it on its loop (µs)", "relay cores",
             "client cores", "silent node decided after", "every node holds the new map after", "evictions"], rows))
    mem = d.get("membership")
    if mem:
        rows = []
        for z in mem["sizes"]:
            rows.append([
                f"{z['ranks']:,}", f"{z['nodes']:,}", ms(z["decide_ms"]["node_lost"]), ms(z["encode_ms"]),
                f"{num(z['state_bytes'] / 1000)} KB", ms(z["assignments_ms"]), ms(z["leader_change_ms"]),
                ms(z["tick_ms"]), f"{num(z['frame_us'])} µs", ms(z.get("straggler_look_ms")), ms(z["status_ms"]),
                f"{num(z['status_bytes'] / 1000)} KB", ms(z["status_stall_ms"]), ms(z["summary_ms"]),
                f"{ms(z['status_node_ms'])}, {num(z['status_node_bytes'] / 1000)} KB",
            ])
        out.append(table(
            ["ranks", "nodes", "decide (node lost)", "encode the state", "state size", "every node's directive",
             "a whole change in the tally", "a quiet tally", "one frame", "a straggler look", "a default Status",
             "its size",
             "loop held by it at most", "summary over every rank", "one node's page, its size"], rows))
    return "\n".join(out)


def render_death_heard(d: dict) -> str:
    """One row a model: seconds from the SIGKILL (medians over kills) to each mark of the reform."""
    def med(run: dict, name: str) -> str:
        return s(run[name]["median"]) if name in run else "–"

    rows = [[r["model"], s(r["steady_step_s"]), f"{r['read_dying']} of {r['kills']}", med(r, "dying_s"),
             med(r, "decided_s"), med(r, "reaped_s"), med(r, "began_s"), med(r, "formed_s"),
             s(r["phases"]["seconds"]), s(r["phases"]["fingerprint_s"])] for r in d["runs"]]
    return table(["model", "steady step", "kill read as it began", "read", "decided", "reaped", "last reform began",
                  "last survivor formed", "reform (slowest)", "its fingerprint wait"], rows)


def render_bench_check(d: dict) -> str:
    rows = [[f"`{name}`", num(f["median"]), ", ".join(num(v) for v in f["runs"]), f["clock"],
             f"+{num(f['tolerance'] * 100)}% + {num(f['slack'])}"] for name, f in d["figures"].items()]
    noise = d["noise"]
    return (f"Commit {d.get('commit') or '?'}, {d['repetitions']} repetitions, in-process figures at "
            f"{d['ranks']:,} ranks; the calibration workload {num(d['calibration_cpu_ms'])} ms of CPU, its spread "
            f"{num(noise['cpu_spread'] * 100)}%, wall over CPU {num(noise['wall_over_cpu'])}; load average "
            f"{num(d['host']['loadavg_at_end'][0], 2)} at its end.\n\n"
            + table(["figure", "baseline (median)", "runs", "clock", "a check fails above"], rows))


def render_scale(d: dict) -> str:
    relayed = "relays" in d
    rate = (f"{num(d['summaries_per_s_per_relay'])} message/s per relay at the leader" if relayed else
            f"{num(d['frames_per_s_per_node'])} frames/s per node at the leader")
    queued = [["every node's new map queued after the decision (CPU)", ms(d["map_queued_ms"])]] \
        if "map_queued_ms" in d else []
    return table(["what", "measured"], [
        ["job", f"{d['ranks']:,} ranks on {d['nodes']:,} nodes, {d['mode']}, {rate}"],
        ["a node's death decided after its last frame", f"{s(d['detection_s'])} "
                                                         f"(heartbeat timeout {num(d['heartbeat_timeout_s'])} s)"],
        ["tally tick p50 / p99 / max", f"{ms(d['tick_ms']['p50'])} / {ms(d['tick_ms']['p99'])} / "
                                       f"{ms(d['tick_ms']['max'])}"],
        ["the change (decide, fenced write, every node's directive)", ms(d["change_ms"])],
        *queued,
        ["the event loop held meanwhile, at most", ms(d["change_loop_held_ms"])],
        [("one relay's summary" if relayed else "one frame") + " in the leader p50 / p99",
         f"{num(d['frame_us']['p50'])} / {num(d['frame_us']['p99'])} µs"],
        ["the leader's CPU", f"{num(d['leader_cpu_cores'])} cores"],
        *([["the process's peak memory (the leader and the simulated nodes)", f"{d['process_rss_mib']:,} MiB"]]
          if "process_rss_mib" in d else []),
        ["evicted", ", ".join(d["evicted"]) + f" (the victim: {d['victim']})"],
    ])


def render_grpc_floor(d: dict) -> str:
    return table(["event loop", "streams", "messages/s offered", "µs on the loop per message (p50)",
                  "µs of process CPU per message (p50)"],
                 [[d["event_loop"], f"{d['streams']:,} ({d['connections']})", num(d["offered_per_s"]),
                   num(d["loop_us_per_message_p50"]), num(d["process_us_per_message_p50"])]])


def render_rank_start(d: dict) -> str:
    life = d.get("life_cpu_s", {})
    return table(["rank (re)start → past its imports", "p50", "max", "CPU, start to exit (p50)"], [
        ["forked from the warm zygote", s(d["warm_s"]["p50"]), s(d["warm_s"]["max"]),
         s(life["warm"]["p50"]) if life else "—"],
        ["a new interpreter (exec wrapper)", s(d["cold_s"]["p50"]), s(d["cold_s"]["max"]),
         s(life["cold"]["p50"]) if life else "—"],
    ]) + f"\nPreloaded: {', '.join(f'`{m}`' for m in d['preload'])}.\n"


def render_churn(d: dict) -> str:
    p = d["parameters"]
    rows = []
    for c in d["checkpoints"]:
        w = c["window"]
        reps = c["replicas"]
        rows.append([
            f"{c['jobs_done']:,}", ms(w["join_ms"]["p50"]), " / ".join(str(r["threads"]) for r in reps),
            " / ".join(num(r["rss_mib"]) for r in reps), max(r["jobs_known"] for r in reps),
            max(r["election_keys"] for r in reps), f"{c['etcd']['muster_keys']:,}",
            f"{num(c['etcd']['db_size_bytes'] / 2**20)} MiB",
        ])
    out = [f"{p['jobs']:,} jobs of {p['nodes_per_job']} nodes, {p['concurrent']} at a time, {p['replicas']} replicas, "
           f"`--retain-finished {p['retain_finished'] or '7d (default)'}`; {num(d['totals']['churn_s'])} s in all.\n",
           table(["jobs done", "Join p50", "threads per replica", "RSS per replica (MiB)", "jobs known (most)",
                  "election keys (most)", "/muster/ keys in etcd", "etcd db"], rows)]
    restart = d.get("restart")
    if restart:
        rows = [[label, s(r["readyz_s"]), s(r["first_join_s"])]
                for label, r in (("over the etcd of every finished run", restart.get("same_etcd")),
                                 ("over an empty etcd", restart.get("empty_etcd"))) if r]
        out.append("A replica restarted afterwards:\n\n" + table(["replica started", "ready after",
                                                                    "first Join answered after"], rows))
    return "\n".join(out)


def render_abuse(d: dict) -> str:
    f, rss, loop, other = d["flood"], d["replica_rss_mib"], d["loop_held_ms"], d["other_job"]
    during = loop["status_latency_during"]
    before, after = other["steps_per_node_before"], other["steps_per_node_during"]
    rows = [
        ["the flood", f"{f['messages']} messages of {f['frames_per_message']:,} frames "
                      f"({num(f['message_bytes'] / 1e6)} MB each) over {s(f['duration_s'])}"],
        ["messages the replica took", f"{f['messages_taken']} (ended by the replica: {num(f['ended_by_replica'])}; "
                                      f"{f['status']})"],
        ["the replica's memory", f"+{num(rss['peak_growth'])} MiB at peak, +{num(rss['growth_after'])} MiB after"],
        ["a Status meanwhile p50 / p99 / max", f"{ms(during['p50'])} / {ms(during['p99'])} / {ms(during['max'])}"],
        [f"another job's steps per node: in {num(other['baseline_s'])} s before / during the flood",
         f"{' '.join(map(str, before))} / {' '.join(map(str, after))}"],
        ["another job's new generation / errors", f"{num(other['new_generation'])} / {other['errors']}"],
    ]
    note = f"\n{cell(d['note'])}\n" if d.get("note") else ""
    return table(["what", "measured"], rows) + note + render_attacks(d.get("attacks", {}))


def render_attacks(attacks: dict) -> str:
    """Security reviews 4 and 5's attacks (tokens on): those on the replica with what each cost it
    and the other job; then those on other surfaces (etcd's peer port, the page's port, a rank's
    store) with what each reached."""
    on_replica = {name: a for name, a in attacks.items() if "replica" in a}
    rows = [[name.replace("_", " "), ", ".join(f"{n} {code}" for code, n in sorted((a.get("ended") or
                                                                                   a.get("answered")).items())),
             f"+{num(a['replica']['rss_peak_growth_mib'])} MiB", s(a["replica"]["cpu_s"]),
             f"{a['replica']['log_bytes']:,}", f"{num(a['other_job']['new_generation'])} / {a['other_job']['errors']}"]
            for name, a in on_replica.items()]
    out = "\n" + table(["attack", "answered", "peak memory", "CPU", "log bytes",
                        "other job: new generation / errors"], rows) if rows else ""
    reached = [[name.replace("_", " "), cell(REACHED[name](a))] for name, a in attacks.items()
               if name not in on_replica and name in REACHED]
    return out + ("\n" + table(["attack", "what it reached"], reached) if reached else "")


REACHED = {
    "etcd_peer_port": lambda a: (f"peer listeners {', '.join(a['peer_urls'])} ({len(a['tcp_peer_urls'])} on TCP); "
                                 f"POSTs as nobody: {a['posts_as_nobody']}; etcd alive after: "
                                 f"{num(a['etcd_alive_after'])}, restarts {a['etcd_restarts']}"),
    "page_port": lambda a: (f"{a['connections']} idle connections: threads {a['threads']['before']} -> "
                            f"{a['threads']['peak']} at peak, +{num(a['rss_mib']['peak_growth'])} MiB; "
                            f"{a['closed_within_5s']} closed within 5 s, held {s(a['held_longest_s'])} at most; "
                            f"/healthz after {a['healthz_after']['status']} in {ms(a['healthz_after']['ms'])}"),
    "store_planting": lambda a: (f"{a['trials']} attacked transfers, {a['keys_planted']} keys planted: payloads run "
                                 f"{a['payload_ran']}, ranks ending with another state {a['wrong_state']}; "
                                 "outcomes " + ", ".join(f"{n} {o}" for o, n in a["rank_outcomes"].items())),
}


if __name__ == "__main__":
    sys.exit(main())
