#!/usr/bin/env python3
"""The daemon's module map and the check that daemon/src keeps it: this file is its one source.
It runs the Python package's check beside it: tests/check_layers_py.py, the one source of that
package's import table.

    python3 tests/check_layers.py              # check both; exit 1 listing every violation
    python3 tests/check_layers.py --self-test  # both checkers' own tables of cases

Layers: every `crate::…` (or `weightstream_daemon::…`, `super::…` leaving the module) path in
daemon/src/**/*.rs names a top-level module; ALLOWED below says which ones each module may name.
Paths in comments and string literals do not count; grouped and multi-line `use` trees do. Modules
below the edge (WIRE_FREE) must not name the wire either: `tonic*` or `weightstream_proto::v1`.

Cycles: no two modules of daemon/src import each other, directly or around a loop, counted file by
file (store/registry.rs and store/upload.rs are two modules). A module's own submodules are part of
it (a `mod.rs` declares and re-exports them, they use its types): edges between a module and its
ancestors do not count. A name a module re-exports (`pub use self::x::Name`) counts as `x`'s.
Standard library only.
"""

import re
import sys
from pathlib import Path
from typing import NamedTuple

from check_layers_py import check_py_tree, py_self_test, report_py

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "daemon" / "src"

# The module map. The data path, top to bottom: server (the gRPC edge and the handoff socket:
# validation, status mapping, start-up, drain) -> core (shared state, peers, the fds clients pass
# and fetch) -> session (actors, staging arenas, plans) -> residency -> scheduler -> store
# (registry, load, upload, state regions, pin) -> mem (memfd mappings, host arenas and slices,
# the HostPinner seam); backend (host, CUDA: the only FFI) -> mem, beside the store. metrics (the
# Prometheus collector and endpoint) sits between server and core: the server starts it, it reads
# the core. A module may name any module below it, and nothing else. config, quota, pacing and
# terminal are leaves that others read: config (the daemon's settings, and the checked copy rate)
# imports nothing, pacing (the copy token bucket and its clock) and quota (per-uid limits) only
# config, terminal (names escaped for people's terminals) nothing. The `weightstream` binary
# (crate weightstream-cli, daemon/cli/) sits on top; "main" and "cli" are its rows.
_BELOW_SCHEDULER = {"store", "backend", "mem", "config", "quota", "pacing", "terminal"}
_BELOW_CORE = {"session", "residency", "scheduler"} | _BELOW_SCHEDULER
ALLOWED = {
    "main": {"cli", "server", "metrics", "core"} | _BELOW_CORE,
    "cli": {"server", "metrics", "core"} | _BELOW_CORE,
    "server": {"metrics", "core"} | _BELOW_CORE,
    "metrics": {"core"} | _BELOW_CORE,
    "core": _BELOW_CORE,
    "session": {"residency", "scheduler"} | _BELOW_SCHEDULER,
    "residency": {"scheduler"} | _BELOW_SCHEDULER,
    "scheduler": _BELOW_SCHEDULER,
    "store": {"mem", "quota", "config", "terminal"},
    "backend": {"mem"},
    "mem": set(),
    "quota": {"config"},
    "config": set(),
    "pacing": {"config"},
    "terminal": set(),
}
# Below the edge: no tonic, no generated gRPC code (the server converts at the edge).
WIRE_FREE = {
    "core",
    "session",
    "residency",
    "scheduler",
    "store",
    "mem",
    "backend",
    "pacing",
    "terminal",
}


class Violation(NamedTuple):
    file: str
    line: int
    kind: str  # "layer", "wire", "unknown" (a module the table does not place) or "cycle"
    src: str
    dst: str
    path: str

    def rule(self):
        if self.kind == "cycle":
            return f"cycle: {self.path}"
        if self.kind == "wire":
            return f"{self.src}: wire type"
        if self.kind == "unknown":
            return f"{self.src if self.dst == '?' else self.dst}: not in the layer table"
        return f"{self.src} -> {self.dst}"


# --- a small Rust tokenizer: identifiers, `::` and punctuation, with line numbers; comments,
# strings and char literals dropped.
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RAW_STR = re.compile(r'b?r(#*)"')
_CHAR = re.compile(r"b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'")


def tokenize(text):
    toks, i, line, n = [], 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line, i = line + 1, i + 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += text[i] == "\n"
                    i += 1
        elif (m := _RAW_STR.match(text, i)) and (c in "rb"):
            end = '"' + m.group(1)
            j = text.find(end, m.end())
            j = n if j < 0 else j
            line += text.count("\n", i, j)
            i = j + len(end)
        elif c == '"' or text.startswith('b"', i):
            i += 1 if c == '"' else 2
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    i += 1
                line += i < n and text[i] == "\n"
                i += 1
            i += 1
        elif c in "'b" and (m := _CHAR.match(text, i)):
            i = m.end()
        elif m := _IDENT.match(text, i):
            toks.append((m.group(), line))
            i = m.end()
        elif text.startswith("::", i):
            toks.append(("::", line))
            i += 2
        else:
            toks.append((c, line))
            i += 1
    return toks + [("", line)] * 4


def _is_ident(tok):
    return bool(_IDENT.fullmatch(tok))


def parse_tree(toks, i):
    """A path or `use` tree at toks[i]: ([[(segment, line), ...] per leaf], next index)."""
    tok, line = toks[i]
    if tok == "{":
        i, leaves = i + 1, []
        while toks[i][0] not in ("}", ""):
            sub, i = parse_tree(toks, i)
            leaves += sub
            while toks[i][0] not in (",", "}", ""):  # `as alias`
                i += 1
            if toks[i][0] == ",":
                i += 1
        return leaves, i + 1
    if not (_is_ident(tok) or tok == "*"):
        return [], i
    segs, i = [(tok, line)], i + 1
    while toks[i][0] == "::":
        nxt = toks[i + 1][0]
        if nxt == "{":
            sub, i = parse_tree(toks, i + 1)
            return [segs + s for s in sub], i
        if not (_is_ident(nxt) or nxt == "*"):
            break  # a turbofish: `crate::f::<T>`
        segs.append(toks[i + 1])
        i += 2
    return [segs], i


def component_of(rel):
    """('store', ['store', 'load']) for store/load.rs; ('main', []) for main.rs."""
    parts = list(rel.parts)
    stem = parts[-1][:-3]
    mod_path = parts[:-1] + ([] if stem in ("mod", "lib", "main") else [stem])
    if len(parts) == 1:
        return stem, mod_path
    return parts[0], mod_path


class Use(NamedTuple):
    line: int
    head: str  # "crate", "weightstream_daemon", "super", "self", or a wire crate's name
    full: list  # crate/super/self: the path from the crate root; a wire crate: as written
    public: bool  # in a `pub use` (a re-export)
    test: bool  # in an inline `#[cfg(test)] mod`


def scan(rel, text):
    """Every path in one file (`rel` relative to daemon/src) that starts at the crate, `super`,
    `self` (in a `use` only) or a wire crate (`tonic*`, `weightstream_proto`): one Use a leaf."""
    src, file_mod = component_of(rel)
    toks = tokenize(text)
    inline = []  # (name, brace depth, #[cfg(test)]) of the inline `mod name { … }` we are in
    depth = 0
    public_at = -1  # the token index where the last `pub use` tree starts
    out = []
    i = 0
    while i < len(toks) - 4:
        tok, line = toks[i]
        prev = toks[i - 1][0] if i else ""
        starts_path = prev != "::" or not (i >= 2 and _is_ident(toks[i - 2][0]))
        if tok == "{":
            depth += 1
        elif tok == "}":
            if inline and inline[-1][1] == depth:
                inline.pop()
            depth -= 1
        elif tok == "mod" and _is_ident(toks[i + 1][0]) and toks[i + 2][0] == "{":
            attr = "".join(t for t, _ in toks[max(i - 7, 0) : i])
            inline.append((toks[i + 1][0], depth + 1, attr == "#[cfg(test)]"))
        elif tok == "use" and (prev == "pub" or (prev == ")" and toks[i - 3][0] == "pub")):
            public_at = i + 1
        if not starts_path or toks[i + 1][0] != "::":
            i += 1
            continue
        here = file_mod + [name for name, _, _ in inline]
        test = any(t for _, _, t in inline)
        if tok in ("crate", "weightstream_daemon", "super") or (tok == "self" and prev == "use"):
            base, j = [], i + 2
            if tok == "super":
                ups = 1
                while toks[j][0] == "super" and toks[j + 1][0] == "::":
                    ups, j = ups + 1, j + 2
                if ups > len(here) or src == "main":
                    i = j
                    continue
                base = here[: len(here) - ups]
            elif tok == "self":
                base = here
            leaves, j = parse_tree(toks, j)
            for leaf in leaves:
                full = base + [s for s, _ in leaf]
                out.append(Use(leaf[-1][1], tok, full, i == public_at, test))
            i = max(j, i + 1)
            continue
        if tok == "tonic" or tok.startswith("tonic_") or tok == "weightstream_proto":
            leaves, j = parse_tree(toks, i)
            for leaf in leaves:
                out.append(Use(leaf[-1][1], tok, [s for s, _ in leaf], False, test))
            i = max(j, i + 1)
            continue
        i += 1
    return out


def check_source(rel, text):
    """Every layer and wire violation in one file (`rel` relative to daemon/src)."""
    src, _ = component_of(rel)
    shown = f"daemon/src/{rel}"
    if src == "lib":
        return []
    if src not in ALLOWED:
        return [Violation(shown, 1, "unknown", src, "?", "(this module)")]
    out = []
    for use in scan(rel, text):
        if use.head == "self":
            continue
        if use.head in ("crate", "weightstream_daemon", "super"):
            dst = use.full[0] if use.full else ""
            if not _is_ident(dst) or dst in ("self", "super") or dst == src:
                continue
            # In main.rs `crate` is the binary; the library there is `weightstream_daemon`.
            if (src == "main") != (use.head == "weightstream_daemon") and use.head != "super":
                continue
            path = "crate::" + "::".join(use.full)
            if dst not in ALLOWED:
                if (SRC / dst).is_dir() or (SRC / f"{dst}.rs").is_file():
                    out.append(Violation(shown, use.line, "unknown", src, dst, path))
            elif dst not in ALLOWED[src]:
                out.append(Violation(shown, use.line, "layer", src, dst, path))
        elif src in WIRE_FREE and (use.head != "weightstream_proto" or use.full[1:2] == ["v1"]):
            out.append(Violation(shown, use.line, "wire", src, use.head, "::".join(use.full)))
    return out


def module_graph(sources):
    """{module: {module it imports: (file, line) of the first such path}} over `sources`
    ({path relative to daemon/src: text}), one module per file; a module's imports of its own
    ancestors and descendants left out, and those of its inline `#[cfg(test)]` modules (tests
    sit above the code they test)."""
    mods = [component_of(rel)[1] for rel in sources]
    files = {tuple(mod[:n]) for mod in mods for n in range(len(mod) + 1)}
    uses = {rel: scan(rel, text) for rel, text in sources.items()}
    reexports = {}  # (module, name) -> the path it re-exports
    for rel, found in uses.items():
        here = tuple(component_of(rel)[1])
        for use in found:
            if use.public and use.head == "self" and len(use.full) > len(here) + 1:
                reexports[(here, use.full[-1])] = use.full

    def resolve(path):
        for _ in range(8):  # a re-export of a re-export, a few deep
            mod = ()
            for seg in path:
                if mod + (seg,) not in files:
                    break
                mod += (seg,)
            target = reexports.get((mod, path[len(mod)] if len(path) > len(mod) else None))
            if target is None or target == path:
                return mod
            path = target
        return mod

    graph = {}
    for rel, found in uses.items():
        here = tuple(component_of(rel)[1])
        edges = graph.setdefault(here, {})
        for use in found:
            if use.test or use.head not in ("crate", "super", "self"):
                continue
            dst = resolve(use.full)
            if dst[: len(here)] != here and here[: len(dst)] != dst:
                edges.setdefault(dst, (f"daemon/src/{rel}", use.line))
    return graph


def find_cycles(graph):
    """One Violation per cycle of `graph` (each found from its smallest module, once)."""
    out, seen = [], set()

    def walk(start, node, trail):
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                if frozenset(trail) not in seen:
                    seen.add(frozenset(trail))
                    file, line = graph[start][trail[1] if len(trail) > 1 else start]
                    shown = " -> ".join("::".join(m) for m in trail + [start])
                    out.append(Violation(file, line, "cycle", "::".join(start), "", shown))
            elif nxt > start and nxt not in trail:
                walk(start, nxt, trail + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return out


def check_tree():
    sources = {p.relative_to(SRC): p.read_text(encoding="utf-8") for p in sorted(SRC.rglob("*.rs"))}
    out = []
    for rel, text in sources.items():
        out += check_source(rel, text)
    return out + find_cycles(module_graph(sources))


def report(violations):
    if not violations:
        print("check_layers: daemon/src keeps its layers (every import points down, no cycle)")
        return 0
    violations.sort(key=lambda v: (v.file, v.line))
    width = max(len(f"{v.file}:{v.line}") for v in violations)
    rwidth = max(len(v.rule()) for v in violations)
    print(f"violations ({len(violations)}):")
    for v in violations:
        shown = "" if v.kind == "cycle" else v.path
        print(f"  {f'{v.file}:{v.line}':<{width}}  {v.rule():<{rwidth}}  {shown}".rstrip())
    if any(v.kind == "layer" for v in violations):
        print("allowed imports of the modules above:")
    for src in sorted({v.src for v in violations if v.kind == "layer"}):
        print(f"  {src} -> {', '.join(sorted(ALLOWED[src])) or '(nothing)'}")
    if any(v.kind == "wire" for v in violations):
        print(f"  no tonic / weightstream_proto::v1 in: {', '.join(sorted(WIRE_FREE))}")
    if any(v.kind == "cycle" for v in violations):
        print("  a cycle: move what both sides name below them, so that imports go one way")
    print(f"check_layers: FAILED: {len(violations)} violations")
    return 1


# (file under daemon/src, source, expected {(line, rule)}): one behaviour per case.
SELF_TEST = [
    ("backend/host.rs", "use crate::store::Model;", {(1, "backend -> store")}),
    ("store/load.rs", "use crate::mem::align_up;\nuse crate::quota::HostQuota;", set()),
    (
        "backend/mod.rs",
        "use crate::{\n    mem::HostSlice,\n    store::Model,\n};",
        {(3, "backend -> store")},
    ),
    (
        "backend/mod.rs",
        "use crate::mem::{self, shm::{ShmDir as D}};\nlet s = crate::store::f();",
        {(2, "backend -> store")},
    ),
    (
        "mem/shm.rs",
        "// use crate::store::X;\n/* crate::store /* nested */ */\n"
        'let s = "crate::store::y";\nlet r = r#"crate::store"#;',
        set(),
    ),
    (
        "backend/cuda/mod.rs",
        "fn f<'a>(x: &'a str) -> char { '\"' }\nuse crate::store::X;",
        {(2, "backend -> store")},
    ),
    ("store/mod.rs", "use super::backend::Backend;", {(1, "store -> backend")}),
    ("store/registry.rs", "mod tests {\n    use super::super::upload::Upload;\n}", set()),
    (
        "store/registry.rs",
        "mod tests {\n    use super::super::super::backend::B;\n}",
        {(2, "store -> backend")},
    ),
    ("residency.rs", "use crate::scheduler::CopyScheduler;", set()),
    ("scheduler.rs", "use crate::residency::ResidentSet;", {(1, "scheduler -> residency")}),
    ("quota.rs", "use crate::config::Quotas;\nuse crate::store::Store;", {(2, "quota -> store")}),
    (
        "metrics.rs",
        "use crate::core::Daemon;\nuse crate::server::serve;",
        {(2, "metrics -> server")},
    ),
    ("session/actor.rs", "use tonic::{Status, Streaming};", {(1, "session: wire type")}),
    ("store/mod.rs", "use weightstream_proto::{handoff,\n v1};", {(2, "store: wire type")}),
    ("store/mod.rs", "use weightstream_proto::v1::Dtype;", {(1, "store: wire type")}),
    ("config.rs", "use weightstream_proto::socket::SocketCandidates;", set()),
    ("server/mod.rs", "use tonic::Status;\nuse weightstream_proto::v1 as pb;", set()),
    ("main.rs", "fn main() { weightstream_daemon::cli::main() }", set()),
    ("main.rs", "use weightstream_daemon::store::x;", set()),
    ("core.rs", "use crate::server::conn::Peer;", {(1, "core -> server")}),
    ("wire.rs", "use crate::mem::align_up;", {(1, "wire: not in the layer table")}),
    ("store/mod.rs", "use crate::no_such_module::X;", set()),
]


# ({file under daemon/src: source}, expected {(file, line, rule)}): one behaviour per case.
CYCLE_TEST = [
    (  # two files of one module that import each other
        {
            "store/registry.rs": "use super::upload::Upload;",
            "store/upload.rs": "use super::registry::{Pending, Reservation};",
        },
        {
            (
                "daemon/src/store/registry.rs",
                1,
                "cycle: store::registry -> store::upload -> store::registry",
            )
        },
    ),
    (  # one way only
        {
            "store/registry.rs": "use super::upload::Upload;\nuse super::reserve::Pending;",
            "store/upload.rs": "use super::reserve::{Pending, Reservation};",
            "store/reserve.rs": "use super::Store;",
        },
        set(),
    ),
    (  # a module and its parent: the parent declares and re-exports it
        {
            "store/mod.rs": "mod registry;\npub use self::registry::HostUse;\n"
            "use self::registry::Inner;",
            "store/registry.rs": "use super::{Model, Store};\nuse crate::store::Owner;",
        },
        set(),
    ),
    (  # around a loop of three, through a name re-exported by the parent, in a grouped `use`
        {
            "store/mod.rs": "pub use self::load::{LoadSource, Progress};",
            "store/load.rs": "use super::cache::Evict;",
            "store/cache.rs": "use crate::store::{\n    Owner,\n    state::StateRegion,\n};",
            "store/state.rs": "use super::LoadSource;",
        },
        {
            (
                "daemon/src/store/cache.rs",
                3,
                "cycle: store::cache -> store::state -> store::load -> store::cache",
            )
        },
    ),
    (  # across top-level modules, file by file
        {
            "session/actor.rs": "use crate::scheduler::CopyScheduler;",
            "scheduler.rs": "use crate::session::actor::Actor;",
        },
        {("daemon/src/scheduler.rs", 1, "cycle: scheduler -> session::actor -> scheduler")},
    ),
    (  # a test module may use what uses its module; comments and strings do not count
        {
            "store/load.rs": "#[cfg(test)]\nmod tests {\n    use crate::store::test_support::f;\n}",
            "store/test_support.rs": "use super::load::LoadSource;\n// use super::upload::X;",
            "store/upload.rs": 'let s = "super::test_support::f";',
        },
        set(),
    ),
    (  # a test module that is not cfg(test) counts
        {
            "store/load.rs": "mod helpers {\n    use crate::store::test_support::f;\n}",
            "store/test_support.rs": "use super::load::LoadSource;",
        },
        {
            (
                "daemon/src/store/load.rs",
                2,
                "cycle: store::load -> store::test_support -> store::load",
            )
        },
    ),
]


def self_test():
    failed = 0
    for rel, text, expected in SELF_TEST:
        got = {(v.line, v.rule()) for v in check_source(Path(rel), text)}
        if got != expected:
            failed += 1
            print(f"FAIL {rel}: {text!r}\n  expected {sorted(expected)}\n  got      {sorted(got)}")
    for sources, expected in CYCLE_TEST:
        graph = module_graph({Path(rel): text for rel, text in sources.items()})
        got = {(v.file, v.line, v.rule()) for v in find_cycles(graph)}
        if got != expected:
            failed += 1
            print(f"FAIL {sorted(sources)}\n  expected {sorted(expected)}\n  got {sorted(got)}")
    total = len(SELF_TEST) + len(CYCLE_TEST)
    print(f"check_layers self-test: {total - failed}/{total} cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    if "--self-test" in sys.argv[1:]:
        sys.exit(self_test() | py_self_test())
    sys.exit(report(check_tree()) | report_py(check_py_tree()))
