"""The packages' layering, read from their imports (no Ray, no import of rdt itself): no import cycle, no import of
a module in a higher layer, no transport reaching into the cores, and rdt using rdt_transports only through its
public API and the shared helpers it lists.

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING`` (a type a lower module needs
belongs lower, or in a Protocol). ``python tests/test_layering.py [ROOT]`` prints what it finds in the tree at
ROOT (default: this checkout), e.g. an older checkout's.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rdt", "rdt_transports")

# Top to bottom; a module may import its own layer and those below. "=name" is the package's __init__ only, any
# other entry is a package and everything below it. Within a layer the no-cycle rule holds.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("=rdt",),  # the public face
    ("rdt._api", "rdt._sharded"),  # tensor_method and put, get, groups/stats/configure; sharded weight sync
    ("rdt._producer", "rdt._consumer"),  # the two roles
    ("rdt._process",),  # the process context: holds every transport's state by name
    ("rdt.transports.group", "rdt.transports.shm", "rdt.transports.nixl", "rdt.transports.cuda_ipc",
     "rdt.transports.object_store", "rdt.transports.inline"),  # one folder (or file) per transport
    ("=rdt.transports", "rdt.transports.base", "rdt.transports.receive", "rdt.transports.recv_buffers",
     "rdt.transports.storage_cache", "rdt.transports.busy_targets"),  # the registry, the contract, landing helpers
    ("rdt._control",),  # the control channel
    ("rdt._objects", "rdt._ray"),  # the object model, the Ray seam
    ("rdt.errors",),
    ("=rdt_transports",),  # rdt_transports' public face
    ("rdt_transports.collective",),
    ("rdt_transports._context",),
    ("rdt_transports.group",),
    ("rdt_transports._checked_p2p", "rdt_transports._tensors", "rdt_transports.algorithms"),
    ("rdt_transports.backends",),
    ("rdt_transports._rendezvous", "rdt_transports.types", "rdt_transports._metrics"),
    ("rdt_transports.errors", "rdt_transports._lifecycle", "rdt_transports._proc", "rdt_transports._cma",
     "rdt_transports._memcopy", "rdt_transports._spin",
     "rdt_transports._distribution"),  # process-independent helpers
)

# What a transport may import from rdt besides its own folder: the contract and landing helpers, the object model,
# the control channel, the Ray seam and the errors (never the process context, a role, the API, the registry or
# another transport).
TRANSPORT_MAY_IMPORT = ("rdt.transports.base", "rdt.transports.receive", "rdt.transports.recv_buffers",
                        "rdt.transports.storage_cache", "rdt.transports.busy_targets", "rdt._objects", "rdt._control", "rdt._ray", "rdt.errors")

# What sharded weight sync may import from rdt: it plans (layouts -> runs), keeps versions, replicas and verify, and
# reads through the consumer's one road for reads (rdt._consumer): never a transport, the registry, the control
# channel, the Ray seam or the API.
SHARDED = "rdt._sharded"
SHARDED_MAY_IMPORT = ("rdt._consumer", "rdt._producer", "rdt._objects", "rdt._process", "rdt.errors", SHARDED)
# Modules whose imports all stand at the top of the file (optional dependencies excepted: none there today).
TOP_IMPORTS_ONLY = (SHARDED,)
OPTIONAL_DEPENDENCIES: Tuple[str, ...] = ()

# The private rdt_transports modules rdt may use besides rdt_transports' public API (modules without a leading
# underscore): threads and exit/fork hooks, process liveness and owner locks, GIL-free copies, process_vm_readv.
SHARED_HELPERS = ("rdt_transports._lifecycle", "rdt_transports._proc", "rdt_transports._memcopy",
                  "rdt_transports._cma")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: Dict[str, int] = field(default_factory=dict)  # module imported -> first line
    late: List[int] = field(default_factory=list)  # lines of imports inside a function or class


def _modules(root: Path) -> Dict[str, Module]:
    found: Dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join(parts)] = Module(".".join(parts), path, is_package)
    return found


def _targets(module: Module, node: ast.AST, known: Dict[str, Module]) -> Iterator[str]:
    """The modules an import statement names (a name imported from a package is its submodule where one exists)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        here = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
        here = here[:len(here) - node.level + 1]
        base = ".".join(here + ([node.module] if node.module else []))
    for a in node.names:
        sub = f"{base}.{a.name}"
        compiled = base in known and known[base].is_package and any(known[base].path.parent.glob(f"{a.name}.*"))
        yield sub if sub in known or compiled else base  # a compiled submodule is outside the graph


def _read_imports(modules: Dict[str, Module]) -> None:
    for m in modules.values():
        tree = ast.parse(m.path.read_text(), str(m.path))
        for scope in ast.walk(tree):
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                m.late += [n.lineno for n in ast.walk(scope) if isinstance(n, (ast.Import, ast.ImportFrom))
                           and not _optional(n) and n.lineno not in m.late]  # nested scopes: once a line
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(m, node, modules):
                    if t.split(".")[0] in PACKAGES and t != m.name and t in modules:
                        m.imports.setdefault(t, node.lineno)


def _optional(node: ast.AST) -> bool:
    """Whether an import statement names only optional dependencies."""
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return bool(names) and all(n.split(".")[0] in OPTIONAL_DEPENDENCIES for n in names) and not getattr(
        node, "level", 0)


def _within(name: str, entry: str) -> bool:
    if entry.startswith("="):
        return name == entry[1:]
    return name == entry or name.startswith(entry + ".")


def layer_of(name: str) -> Optional[int]:
    """The layer of module ``name`` (0 is the top), by its most specific entry; None if it has none."""
    best: Optional[Tuple[int, int]] = None
    for i, entries in enumerate(LAYERS):
        for e in entries:
            if _within(name, e) and (best is None or len(e) > best[1]):
                best = (i, len(e))
    return None if best is None else best[0]


def _transport_of(name: str) -> Optional[str]:
    """The transport folder (or file) ``name`` belongs to, or None for the registry, contract and helpers."""
    parts = name.split(".")
    if parts[:2] != ["rdt", "transports"] or len(parts) < 3 or layer_of(name) != layer_of("rdt.transports.shm"):
        return None
    return parts[2]


def cycles(modules: Dict[str, Module]) -> List[List[str]]:
    """Every set of modules that import each other (strongly connected, more than one module), sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graphs here are a few hundred edges deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in modules[v].imports:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return sorted(out)


@dataclass
class Report:
    modules: int
    arrows: int
    cycles: List[List[str]]
    unplaced: List[str]
    upward: List[str]
    transport: List[str]
    core: List[str]
    private: List[str]
    sharded: List[str] = field(default_factory=list)
    late: List[str] = field(default_factory=list)

    def problems(self) -> int:
        return (len(self.cycles) + len(self.unplaced) + len(self.upward) + len(self.transport) + len(self.core)
                + len(self.private) + len(self.sharded) + len(self.late))

    def text(self) -> str:
        lines = [f"{self.modules} modules, {self.arrows} import arrows; {len(self.cycles)} cycles, "
                 f"{len(self.upward)} upward imports, {len(self.transport)} transport imports of the core, "
                 f"{len(self.core)} core imports of a transport, {len(self.private)} private rdt_transports imports, "
                 f"{len(self.sharded)} sharded imports off its road, {len(self.late)} imports inside functions, "
                 f"{len(self.unplaced)} modules in no layer"]
        lines += [f"cycle: {' <-> '.join(c)}" for c in self.cycles]
        lines += [f"upward: {u}" for u in self.upward]
        lines += [f"transport: {t}" for t in self.transport]
        lines += [f"core: {c}" for c in self.core]
        lines += [f"private: {p}" for p in self.private]
        lines += [f"sharded: {p}" for p in self.sharded]
        lines += [f"late: {p}" for p in self.late]
        lines += [f"no layer: {u}" for u in self.unplaced]
        return "\n".join(lines)


def analyse(root: Path = ROOT) -> Report:
    """What the imports of the tree at ``root`` show."""
    modules = _modules(root)
    _read_imports(modules)
    unplaced = sorted(n for n in modules if layer_of(n) is None)
    upward, transport, core, private, sharded, late = [], [], [], [], [], []
    lowest_core = layer_of("rdt._process.context")
    for m in modules.values():
        mine, own = layer_of(m.name), _transport_of(m.name)
        if any(_within(m.name, e) for e in TOP_IMPORTS_ONLY):
            late += [f"{m.path.relative_to(root)}:{line}" for line in m.late]
        for t, line in sorted(m.imports.items()):
            where = f"{m.path.relative_to(root)}:{line} imports {t}"
            theirs = layer_of(t)
            if mine is not None and theirs is not None and theirs < mine:
                upward.append(where)
            if own is not None and t.startswith("rdt.") and _transport_of(t) != own \
                    and not any(_within(t, e) for e in TRANSPORT_MAY_IMPORT):
                transport.append(where)
            if mine is not None and mine <= lowest_core and m.name.startswith("rdt") and _transport_of(t) is not None:
                core.append(where)  # the API, roles and context reach transports through the registry only
            if m.name.split(".")[0] == "rdt" and t.startswith("rdt_transports.") and t not in SHARED_HELPERS \
                    and any(p.startswith("_") for p in t.split(".")[1:]):
                private.append(where)
            if _within(m.name, SHARDED) and t.startswith("rdt") and not any(_within(t, e) for e in SHARDED_MAY_IMPORT):
                sharded.append(where)
    arrows = sum(len(m.imports) for m in modules.values())
    return Report(len(modules), arrows, cycles(modules), unplaced, upward, transport, core, private, sharded, late)


def test_no_cycle_no_upward_import_no_transport_reaching_into_the_core_sharded_on_the_consumers_road() -> None:
    report = analyse()
    assert report.problems() == 0, report.text()


def test_the_check_sees_what_it_must_refuse(tmp_path: Path) -> None:
    """The analysis itself: a cycle through a function-level import, an upward import under TYPE_CHECKING, a
    transport importing another one and the context, and a private rdt_transports import are all reported."""
    files = {
        "rdt/__init__.py": "",
        "rdt/errors.py": "",
        "rdt/_objects/__init__.py": "",
        "rdt/_objects/meta.py": "def f():\n    from ..transports import base\n",
        "rdt/_process/__init__.py": "",
        "rdt/_process/context.py": "from rdt_transports import _context\nfrom ..transports.shm import cma\n",
        "rdt/transports/shm/cma.py": "",
        "rdt/transports/__init__.py": "",
        "rdt/transports/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._objects import meta\n",
        "rdt/transports/shm/__init__.py": "",
        "rdt/transports/shm/transport.py": "from ..nixl import read\nfrom ..._process.context import x\n",
        "rdt/transports/nixl/__init__.py": "",
        "rdt/transports/nixl/read.py": "from ..shm.transport import y\n",
        "rdt_transports/__init__.py": "",
        "rdt_transports/_context.py": "",
        "rdt/_sharded/__init__.py": "",
        "rdt/_sharded/load.py": "from ..transports import base\ndef f():\n    import os\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    report = analyse(tmp_path)
    assert ["rdt._objects.meta", "rdt.transports.base"] in report.cycles
    assert ["rdt.transports.nixl.read", "rdt.transports.shm.transport"] in report.cycles
    assert any("meta.py:2 imports rdt.transports.base" in u for u in report.upward)
    assert any("shm/transport.py:2 imports rdt._process.context" in u for u in report.upward)
    assert sorted(t.split(" imports ")[1] for t in report.transport) == [
        "rdt._process.context", "rdt.transports.nixl.read", "rdt.transports.shm.transport"]
    assert [p.split(" imports ")[1] for p in report.private] == ["rdt_transports._context"]
    assert [c.split(" imports ")[1] for c in report.core] == ["rdt.transports.shm.cma"]
    assert [c.split(" imports ")[1] for c in report.sharded] == ["rdt.transports.base"]
    assert report.late == ["rdt/_sharded/load.py:3"]


if __name__ == "__main__":
    found = analyse(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
    print(found.text())
    sys.exit(1 if found.problems() else 0)
