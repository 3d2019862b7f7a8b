#!/usr/bin/env python3
"""Checks that every `weightstream` command the documents show exists: each subcommand, and each
--flag given to it, is in that subcommand's `--help`.

    python3 tests/check_doc_commands.py [--bin target/debug/weightstream]
    python3 tests/check_doc_commands.py --self-test   # the extractor's table of cases, and a
                                                      # made-up flag and subcommand caught

Documents: README.md and every README.md and DESIGN.md below the repository root (not target/,
.venv/ or hidden directories). Commands are read from fenced code blocks (not those in a
programming or data language: python, rust, toml, yaml, json) and from inline code. `weightstream`
(or a path ending in /weightstream, or `cargo run [--release] --`) counts as the command only at
the start of a command: the start of a line or span, after `$ ` or `sudo `, after environment
assignments (`WEIGHTSTREAM_LOG=debug weightstream serve`), or after `&&`, `||`, `;`, `|` or `$(`.
So `--modes resident weightstream` (an argument's value) is not a command. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"target", ".venv", "node_modules"}
# Code blocks in these languages hold code, not shell commands.
NOT_SHELL = {"python", "py", "rust", "rs", "toml", "yaml", "yml", "json", "ini", "proto"}

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")
# Where a command may start within a line: the start, or after one of these.
COMMAND_START = re.compile(r"(?:^|&&|\|\||;|\||\$\(|\$ |\bsudo )\s*")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
PROGRAM = re.compile(r"(?:\S*/)?weightstream$")
# Where a command ends: a comment, a control operator, a closing parenthesis or backtick.
COMMAND_END = re.compile(r"\s#|&&|\|\||;|\||\)|&\s|&$")
SUBCOMMAND = re.compile(r"[a-z][a-z0-9-]*$")


class Command(NamedTuple):
    """`weightstream SUB --flag …` as a document writes it (`sub` None: no subcommand)."""

    where: str
    text: str
    sub: str | None
    flags: tuple[str, ...]


def documents(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name in ("README.md", "DESIGN.md"):
                found.append(Path(dirpath) / name)
    return found


def snippets(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every shell line of a fenced block and every inline code span."""
    out: list[tuple[int, str]] = []
    lines = text.split("\n")
    fence: str | None = None
    shell = False
    prose: list[tuple[int, str]] = []
    pending = ""
    for number, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, shell = m.group(2), m.group(3).lower() not in NOT_SHELL
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            elif shell:
                # A trailing backslash continues the command on the next line.
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                out.append((number, pending + line))
                pending = ""
            continue
        prose.append((number, line))
    # Inline code, within a paragraph (a span may wrap onto the next line).
    paragraph: list[tuple[int, str]] = []
    for number, line in [*prose, (0, "")]:
        if line.strip():
            paragraph.append((number, line))
            continue
        if paragraph:
            joined = "\n".join(text for _, text in paragraph)
            for m in INLINE.finditer(joined):
                first = paragraph[joined.count("\n", 0, m.start())][0]
                out.append((first, m.group(1).replace("\n", " ")))
        paragraph = []
    return out


def commands(where: str, line: str) -> list[Command]:
    """The weightstream commands that start somewhere in `line`."""
    found = []
    for start in COMMAND_START.finditer(line):
        rest = line[start.end() :]
        end = COMMAND_END.search(rest)
        words = (rest[: end.start()] if end else rest).split()
        while words and ASSIGNMENT.fullmatch(words[0]):
            words = words[1:]
        if words[:2] == ["cargo", "run"] and "--" in words:
            words = ["weightstream", *words[words.index("--") + 1 :]]
        if not words or not PROGRAM.fullmatch(words[0]):
            continue
        args = words[1:]
        sub = subcommand(args)
        if sub is not None and not SUBCOMMAND.fullmatch(sub):
            continue  # a placeholder (`…`, `<command>`, `SUB`): nothing to check
        flags = tuple(a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2)
        text = " ".join(words)
        found.append(Command(where, text, sub, flags))
    return found


def subcommand(args: list[str]) -> str | None:
    """The first word that is not an option: the options before a subcommand are the global
    ones (--socket, --log-format), which take a value (`--socket /s status`)."""
    taking_value = False
    for a in args:
        if taking_value:
            taking_value = False
        elif a.startswith("--"):
            taking_value = "=" not in a and a not in ("--help", "--version")
        elif not a.startswith("-"):
            return a
    return None


def extract(path: Path, root: Path) -> list[Command]:
    name = path.relative_to(root) if path.is_relative_to(root) else path
    out = []
    for number, snippet in snippets(path.read_text()):
        out.extend(commands(f"{name}:{number}", snippet))
    return out


class Helps:
    """`weightstream [SUB] --help` of the binary, run once per subcommand."""

    def __init__(self, binary: str):
        self.binary = binary
        self.cache: dict[str | None, str | None] = {}

    def flags(self, sub: str | None) -> set[str] | None:
        """The --flags SUB's help names; None when SUB is no subcommand."""
        if sub not in self.cache:
            argv = [self.binary, *([sub] if sub else []), "--help"]
            run = subprocess.run(argv, capture_output=True, text=True)
            self.cache[sub] = run.stdout if run.returncode == 0 else None
        text = self.cache[sub]
        if text is None:
            return None
        return set(re.findall(r"--[a-z0-9][a-z0-9-]*", text)) | {"--help", "--version"}


def check(found: list[Command], helps: Helps) -> list[str]:
    """One message per command a document names that the binary does not have."""
    problems = []
    for c in found:
        known = helps.flags(c.sub)
        if known is None:
            problems.append(f"{c.where}: `{c.text}`: no subcommand {c.sub!r}")
            continue
        for flag in c.flags:
            if flag not in known:
                sub = f"weightstream {c.sub}" if c.sub else "weightstream"
                problems.append(f"{c.where}: `{c.text}`: {sub} has no {flag}")
    return problems


def self_test(binary: str) -> int:
    cases = [
        (
            "```sh\nweightstream serve --socket /s   # comment --not-a-flag\n```",
            [("serve", ("--socket",))],
        ),
        ("```\n$ sudo weightstream status --json\n```", [("status", ("--json",))]),
        (
            "```bash\nWEIGHTSTREAM_LOG=debug target/release/weightstream load \\\n"
            "  --name x f\n```",
            [("load", ("--name",))],
        ),
        ("```sh\npython bench.py --modes resident weightstream --size 1\n```", []),
        ("```python\nweightstream --not-shell\n```", []),
        ("Run `weightstream top --once` or `weightstream.connect()`.", [("top", ("--once",))]),
        ("A span that wraps: `weightstream status\n--json` here.", [("status", ("--json",))]),
        ("`numactl --interleave=all weightstream serve …`", []),
        ("`weightstream load --quantize fp8 …`", [("load", ("--quantize",))]),
        ("`cargo run --release -- demo --size 8GiB`", [("demo", ("--size",))]),
        (
            "`weightstream --socket /x status && weightstream release m-1`",
            [("status", ("--socket",)), ("release", ())],
        ),
        ("`weightstream <command> --help` or `weightstream SUB --flag`", []),
        ("`weightstream --version`", [(None, ("--version",))]),
    ]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for text, want in cases:
            doc = Path(tmp) / "README.md"
            doc.write_text(text + "\n")
            got = [(c.sub, c.flags) for c in extract(doc, Path(tmp))]
            if got != want:
                failures.append(f"{text!r}: got {got}, want {want}")
        # Against the binary: a made-up flag and a made-up subcommand are caught, real ones pass.
        doc = Path(tmp) / "README.md"
        doc.write_text(
            "```sh\nweightstream status --json --no-such-flag\nweightstream frobnicate\n"
            "weightstream serve --drain-timeout-secs 5 --socket /s\n```\n"
        )
        problems = check(extract(doc, Path(tmp)), Helps(binary))
        want = [
            "README.md:2: `weightstream status --json --no-such-flag`: weightstream status has "
            "no --no-such-flag",
            "README.md:3: `weightstream frobnicate`: no subcommand 'frobnicate'",
        ]
        if problems != want:
            failures.append(f"against {binary}: got {problems}, want {want}")
    for f in failures:
        print("self-test:", f, file=sys.stderr)
    print(f"self-test: {len(cases) + 1 - len(failures)}/{len(cases) + 1} cases pass")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_bin = os.environ.get("WEIGHTSTREAM_BIN", str(ROOT / "target/debug/weightstream"))
    parser.add_argument("--bin", default=default_bin, help="the weightstream binary")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if not Path(args.bin).exists():
        print(f"{args.bin}: no such binary (cargo build --bin weightstream)", file=sys.stderr)
        return 1
    if args.self_test:
        return self_test(args.bin)
    found = [c for doc in documents(ROOT) for c in extract(doc, ROOT)]
    problems = check(found, Helps(args.bin))
    for p in problems:
        print(p, file=sys.stderr)
    docs = len({c.where.rsplit(":", 1)[0] for c in found})
    print(f"{len(found)} weightstream commands in {docs} documents, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
