"""The Python package's import table, and the check that client-py/src/weightstream keeps it:
what each room of the package may import, no import cycle, no module over PY_MAX_LINES lines.
This file is the table's one source; tests/check_layers.py runs its check and its self-test
beside the daemon's (`python3 tests/check_layers.py [--self-test]`). Standard library only.
"""

from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent

# What each room of the package may import (names relative to ``weightstream``; a room is a
# module, or a sub-package with everything under it; "weightstream" is the package face). The
# floors, top to bottom: the faces and integrations -> torch (attach, handle, policy, ...) ->
# torch.host (host-held training) -> client -> session -> regions, _upload, quantize -> _cuda,
# sizes, errors, protocol, _native. Imports inside functions and under TYPE_CHECKING count:
# they are imports all the same. Besides the table, the import graph of the package's modules
# must have no cycle.
PY_SRC = ROOT / "client-py" / "src" / "weightstream"
#: The most lines a module of the package may have.
PY_MAX_LINES = 800
_PY_LEAVES = {"_native", "errors", "protocol", "sizes", "_dtypes", "_deprecated"}
_PY_CORE = _PY_LEAVES | {"_cuda", "_fused_dequant", "_quant8", "quantize", "_wait_timer"}
_PY_CORE |= {"_rans8"}
_PY_CORE |= {"regions", "_upload"}
_PY_CLIENT = _PY_CORE | {"session", "client"}
PY_ALLOWED = {
    "weightstream": {"client", "errors", "protocol"},
    "integrations": {"weightstream", "torch", "torch.host"} | _PY_CLIENT,
    "examples": {"weightstream", "torch"} | _PY_CLIENT,
    "torch": {"weightstream", "torch.host"} | _PY_CLIENT,
    "torch.host": {"torch.ops", "torch.hooks", "torch.policy"} | _PY_CLIENT,
    "client": _PY_CORE | {"session"},
    "session": _PY_CORE,
    "_upload": _PY_LEAVES | {"_cuda", "quantize", "_fused_dequant"},
    "regions": _PY_LEAVES | {"_cuda"},
    "quantize": _PY_LEAVES | {"_fused_dequant"},
    "_fused_dequant": _PY_LEAVES,
    "_rans8": set(),
    "_quant8": set(),
    "_wait_timer": _PY_LEAVES,
    "_cuda": set(),
    "_dtypes": {"_native", "protocol"},
    "protocol": {"_native"},
    "errors": {"_native"},
    "sizes": set(),
    "_native": set(),
    # Deprecated paths, kept for one release: each is the module it names.
    "state": {"regions", "_deprecated"},
    "_ipc": {"regions", "_deprecated"},
    "_deprecated": set(),
}
#: Rooms that are modules of a sub-package the table also places (``torch.host`` under
#: ``torch``): a rule naming one of them names that module alone.
_PY_SUBROOMS = {"torch.ops", "torch.hooks", "torch.policy"}


class PyViolation(NamedTuple):
    file: str
    line: int
    kind: str  # "layer", "unknown", "cycle" or "long" (line = its lines)
    src: str
    dst: str

    def rule(self):
        return {
            "cycle": f"import cycle: {self.dst}",
            "long": f"more than {self.dst} lines: split it by concern",
            "unknown": f"{self.src}: not in the Python layer table",
        }.get(self.kind, f"{self.src} -> {self.dst}")


def py_module_of(rel: Path) -> str:
    """``weightstream.torch.host.layers`` for torch/host/layers.py (``rel`` under PY_SRC)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["weightstream", *parts])


def py_room(module: str) -> str | None:
    """The table's room of ``module``: the face, or the longest name that is the module or a
    package above it; None where the table places it nowhere."""
    rel = module.removeprefix("weightstream").removeprefix(".")
    if not rel:
        return "weightstream"
    best = None
    for room in PY_ALLOWED:
        if room in _PY_SUBROOMS or room == "weightstream":
            continue
        if (rel == room or rel.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def py_imports(module: str, is_package: bool, text: str, known: set[str]):
    """(line, module) of every import of the package's own modules in ``text``, wherever it
    stands (functions, ``if TYPE_CHECKING:``); ``from pkg import name`` names the module
    ``pkg.name`` where there is one, else ``pkg``."""
    import ast

    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.append((node.lineno, name))
    return out


def py_graph(files: dict[str, tuple[str, bool, str]]):
    """module -> {imported module: first line}, for ``files``: module -> (shown path,
    is_package, text)."""
    known = set(files)
    graph = {}
    for module, (_, is_package, text) in files.items():
        edges = {}
        for line, dst in py_imports(module, is_package, text, known):
            edges.setdefault(dst, line)
        graph[module] = edges
    return graph


def py_cycles(graph) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of two or more
    modules (Tarjan's), each sorted, in order."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def py_allowed(src_room: str, dst: str) -> bool:
    rel = dst.removeprefix("weightstream").removeprefix(".") or "weightstream"
    dst_room = py_room(dst)
    allowed = PY_ALLOWED[src_room]
    return dst_room == src_room or dst_room in allowed or rel in allowed


def check_py_files(files: dict[str, tuple[str, bool, str]]):
    """Every violation of the Python table, and every cycle, in ``files`` (see py_graph)."""
    graph = py_graph(files)
    out = []
    for module, edges in sorted(graph.items()):
        shown = files[module][0]
        src = py_room(module)
        if src is None:
            out.append(PyViolation(shown, 1, "unknown", module, "?"))
            continue
        for dst, line in sorted(edges.items(), key=lambda e: e[1]):
            if not py_allowed(src, dst):
                dst_room = py_room(dst) or dst
                out.append(PyViolation(shown, line, "layer", src, dst_room))
    for comp in py_cycles(graph):
        first = comp[0]
        out.append(PyViolation(files[first][0], 1, "cycle", first, " <-> ".join(comp)))
    return out


def check_py_tree():
    files = {}
    for path in sorted(PY_SRC.rglob("*.py")):
        rel = path.relative_to(PY_SRC)
        shown = str(path.relative_to(ROOT))
        files[py_module_of(rel)] = (shown, rel.name == "__init__.py", path.read_text("utf-8"))
    for path in sorted(PY_SRC.rglob("*.pyi")):  # an extension's stub: a module to import
        module = py_module_of(path.relative_to(PY_SRC))
        files.setdefault(module, (str(path.relative_to(ROOT)), False, ""))
    long = [
        PyViolation(shown, lines, "long", module, str(PY_MAX_LINES))
        for module, (shown, _, text) in files.items()
        if (lines := text.count("\n")) > PY_MAX_LINES
    ]
    return check_py_files(files) + long


def report_py(violations):
    if not violations:
        print("check_layers: client-py/src/weightstream keeps its table and has no import cycle")
        return 0
    for v in sorted(violations, key=lambda v: (v.file, v.line)):
        print(f"  {v.file}:{v.line}  {v.rule()}")
    for src in sorted({v.src for v in violations if v.kind == "layer"}):
        print(f"  {src} may import: {', '.join(sorted(PY_ALLOWED[src])) or '(nothing)'}")
    print(f"check_layers: FAILED: {len(violations)} violations in client-py/src/weightstream")
    return 1


# ({module: source}, expected {(module, line, rule)}): one behaviour per case. A module with
# another one under it is a package.
PY_SELF_TEST = [
    (
        {
            "weightstream.session": "from weightstream.client import Client\n",
            "weightstream.client": "",
        },
        {("weightstream.session", 1, "session -> client")},
    ),
    (
        {
            "weightstream.client": "def f():\n    from weightstream.session import Session\n",
            "weightstream.session": "",
        },
        set(),
    ),
    (
        {
            "weightstream.session": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from weightstream import client\n",
            "weightstream.client": "",
        },
        {("weightstream.session", 3, "session -> client")},
    ),
    (
        {
            "weightstream.torch.host.layers": "from weightstream.torch.handle import Handle\n",
            "weightstream.torch.handle": "",
        },
        {("weightstream.torch.host.layers", 1, "torch.host -> torch")},
    ),
    (
        {
            "weightstream.torch.host.layers": "from weightstream.torch import ops, policy\n",
            "weightstream.torch.ops": "",
            "weightstream.torch.policy": "",
            "weightstream.torch": "",
        },
        set(),
    ),
    (
        {
            "weightstream.torch.host.layers": "from .. import hooks\n",
            "weightstream.torch.hooks": "",
        },
        set(),
    ),
    (
        {"weightstream.regions": "import weightstream.torch as wst\n", "weightstream.torch": ""},
        {("weightstream.regions", 1, "regions -> torch")},
    ),
    (
        {"weightstream.wire": "import os\n"},
        {("weightstream.wire", 1, "weightstream.wire: not in the Python layer table")},
    ),
    (
        {
            "weightstream.torch.attach": "import weightstream.torch.handle\n",
            "weightstream.torch.handle": "def f():\n    from weightstream.torch import attach\n",
        },
        {
            (
                "weightstream.torch.attach",
                1,
                "import cycle: weightstream.torch.attach <-> weightstream.torch.handle",
            )
        },
    ),
    (
        {
            "weightstream.integrations.ai_toolkit.loading": "def f():\n"
            "    from weightstream.integrations.ai_toolkit.manager import M\n",
            "weightstream.integrations.ai_toolkit.manager": "from . import loading\n",
        },
        {
            (
                "weightstream.integrations.ai_toolkit.loading",
                1,
                "import cycle: weightstream.integrations.ai_toolkit.loading <-> "
                "weightstream.integrations.ai_toolkit.manager",
            )
        },
    ),
]


def py_self_test():
    failed = 0
    for sources, expected in PY_SELF_TEST:
        files = {}
        for module, text in sources.items():
            package = any(other.startswith(module + ".") for other in sources)
            files[module] = (module, package, text)
        got = {(v.file, v.line, v.rule()) for v in check_py_files(files)}
        if got != expected:
            failed += 1
            print(f"FAIL {sources!r}\n  expected {sorted(expected)}\n  got      {sorted(got)}")
    passed = len(PY_SELF_TEST) - failed
    print(f"check_layers Python self-test: {passed}/{len(PY_SELF_TEST)} cases pass")
    return 1 if failed else 0
