"""The layering docs/architecture.md states ("Where things live", "Import direction"), read from the code: every
``import`` of every module under ``hwsync/``, at module level, under ``TYPE_CHECKING`` and inside functions, parsed
with :mod:`ast` (nothing is imported). A function-level import is still a dependency: it only moves the failure from
import time to call time.

The rules are the folders': hwsync's modules live in five folders, layered bottom to top

    common  <  patches  <  engine  <  trainer  <  integrations  <  the top level (entry modules, public faces, testing)

and a module may import only its own folder or a folder below it: 0 imports run up. ``common/`` is what both
processes run; ``patches/`` the upstream fixes (a leaf); ``engine/`` what runs in the engine's processes (so it never
imports ``trainer/``); ``trainer/`` what runs in the trainer process to plan, produce and check a sync (it may attach
the colocated engine below it); ``integrations/`` the trainer frameworks. A module's layer is the folder it sits in,
so a new file is under the rules by where it is put. No cycles, among modules or among folders.

Fails on an import cycle and on an import across a boundary; each failure names the importing file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hwsync"

LAYERS = ("common", "patches", "engine", "trainer", "integrations")
"""hwsync's folders, bottom to top; everything else at hwsync's top level (the entry modules, the public faces,
``testing/``) is above them all."""
TOP = len(LAYERS)

ENTRY_MODULES = ("__init__", "__main__", "cli", "doctor", "plugin_paths", "testing")
"""What may sit at hwsync's top level besides the layer folders and the public faces."""

PUBLIC_FACES = ("hwsync.server", "hwsync.server.vllm_api", "hwsync.swift", "hwsync.trl", "hwsync.vllm")
"""Paths users type that outlived the move (``--middleware hwsync.server.vllm_api.SyncMiddleware``,
``worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension"``, ``import hwsync.swift``, ``from hwsync.trl import
GRPOTrainer``, ``from hwsync.server import serve``): re-exports only, the code lives in the layer folders."""

VLLM_IMPORTERS = {
    "hwsync.engine.vllm": "everything hwsync does inside vLLM",
    "hwsync.patches": "each patch's target is an upstream library, vLLM's for most",
    "hwsync.common.capabilities": "probes the installed vLLM without an engine (version range, MoE-LoRA kernels) for "
    "`hwsync doctor` and the version check",
    "hwsync.common.target": "the handle's `lora_request` builds vLLM's LoRARequest where vLLM is importable (the "
    "report carries it in both modes; a trainer without vLLM gets None)",
    "hwsync.engine.names.namespace": "reads vLLM's own reload helpers to name what a layer's loader accepts",
    "hwsync.integrations.swift._engine_view": "the view on the vLLM engine ms-swift's rollout builds",
    "hwsync.testing": "builds real vLLM engines and references for the tests",
    "hwsync.engine.served": "the engine host inside vLLM's own API server (`vllm serve`, `trl vllm-serve`): vLLM's "
    "async engine client, its sampling parameters and LoRA registry",
    "hwsync.trainer.verify": "folds the LoRA scaling with vLLM's own LoRALayerWeights.optimize, so the adapter-content "
    "check compares with what vLLM's own loading would hold (where vLLM is importable)",
}
"""Who may import ``vllm`` / ``vllm_ascend``, and why (docs/architecture.md lists the same)."""

LIBRARY_OWNERS = {
    "torch_npu": ("hwsync.common.npu",),
    "swift": ("hwsync.integrations.swift", "hwsync.patches.swift_rollout"),
    "trl": ("hwsync.integrations.trl", "hwsync.patches.trl_vllm_generation"),
}
"""A device library only in its backend's folder; a trainer framework only in its integration package (and the
patch of it)."""

TRANSPORT_MAY_IMPORT = ("hwsync.common.transport", "hwsync.common.wire", "hwsync.common.errors")
PATCHES_MAY_IMPORT = (
    "hwsync.patches",
    "hwsync.common.errors",
    "hwsync.common.quiet",
    "hwsync.common.config",
    "hwsync.common.foreign",
    "hwsync.common.npu.ascend_layouts",
)
"""Patches stay leaves: they fix upstream code and call none of hwsync's sync machinery (a probe's upstream import is
quieted by hwsync.common.quiet, HWSYNC_DISABLE_PATCHES read through hwsync.common.config; the vllm_ascend patch
writes vllm-ascend's processed expert layout, which lives with the NPU backend)."""


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    file: Path
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.file.relative_to(ROOT)}:{self.line} {self.source} imports {self.target} ({where})"


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(["hwsync", *parts])] = f
    return mods


MODULES = _modules()


def _targets(module: str, file: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    base = node.module or ""
    if node.level:
        parts = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    for a in node.names:  # `from pkg import submodule` depends on the submodule
        yield f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base


def _known(target: str) -> str:
    """The hwsync module a dotted name lives in (``hwsync.common.wire.Manifest`` -> ``hwsync.common.wire``); others as
    they are."""
    t = target
    while t.startswith("hwsync") and t not in MODULES and "." in t:
        t = t.rpartition(".")[0]
    return t


def _imports() -> list[Import]:
    out: list[Import] = []
    for module, file in MODULES.items():
        tree = ast.parse(file.read_text(), str(file))

        def walk(node: ast.AST, in_function: bool, module: str = module, file: Path = file) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    out.extend(
                        Import(module, _known(t), file, child.lineno, in_function)
                        for t in _targets(module, file, child)
                    )
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(tree, False)
    unique = {(i.source, i.target, i.line): i for i in out if i.target != i.source}  # `from m import a, b`: once
    return list(unique.values())


IMPORTS = _imports()


def _within(module: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _report(bad: list[Import], rule: str) -> str:
    return f"{len(bad)} import(s) break the rule '{rule}' (docs/architecture.md, Import direction):\n" + "\n".join(
        f"  {i}" for i in bad
    )


def test_the_graph_is_read() -> None:
    """The reader sees both kinds of import (so the rules below cannot pass on an empty graph)."""
    assert len(MODULES) > 50 and "hwsync.patches.rope_config" in MODULES
    pairs = {(i.source, i.target) for i in IMPORTS}
    assert ("hwsync.patches", "hwsync.patches.rope_config") in pairs  # relative, from a package
    assert any(i.in_function for i in IMPORTS) and any(not i.in_function for i in IMPORTS)


def test_no_import_cycles() -> None:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.target in MODULES:
            edges[i.source].add(i.target)
    cycles = _cycles(edges)
    detail = []
    for c in cycles:
        members = set(c)
        detail.append(
            f"  {len(c)} modules: "
            + ", ".join(c)
            + "\n"
            + "\n".join(f"    {i}" for i in IMPORTS if i.source in members and i.target in members)
        )
    assert not cycles, "import cycles (module level and inside functions):\n" + "\n".join(detail)


def _layer(module: str) -> int:
    """The index of the folder a module sits in (``LAYERS``), ``TOP`` for hwsync's top level."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def _layer_name(module: str) -> str:
    return LAYERS[_layer(module)] if _layer(module) < TOP else "the top level"


def _folder(module: str) -> str:
    """The folder (package) a module sits in; a package's ``__init__`` sits in its own folder."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _house_folder(module: str) -> str:
    """The folder of hwsync's top level a module sits in (``hwsync.engine``, ``hwsync.testing``), or ``hwsync``."""
    parts = module.split(".")
    return (
        ".".join(parts[:2])
        if len(parts) > 1 and MODULES.get(".".join(parts[:2]), Path()).name == "__init__.py"
        else "hwsync"
    )


def _hwsync_imports() -> list[Import]:
    return [i for i in IMPORTS if i.target in MODULES]


def test_every_module_sits_in_a_layer_folder_or_is_an_entry_or_a_face() -> None:
    """hwsync's top level holds the layer folders, the entry modules (``ENTRY_MODULES``) and the public faces only,
    so no new module escapes the layer rules by sitting at the top."""
    stray = sorted(
        m
        for m in MODULES
        if _layer(m) == TOP and m != "hwsync" and m.split(".")[1] not in ENTRY_MODULES and not _within(m, PUBLIC_FACES)
    )
    assert not stray, (
        f"modules outside hwsync's layer folders ({', '.join(LAYERS)}): {stray}; put each in the "
        "folder of the process that runs it (docs/architecture.md, Where things live)"
    )
    assert all(f in MODULES for f in PUBLIC_FACES)


def test_no_import_runs_up_the_layers() -> None:
    """A module imports only its own folder or the folders below it (common < patches < engine < trainer <
    integrations < the top level)."""
    bad = [i for i in _hwsync_imports() if _layer(i.target) > _layer(i.source)]
    detail = "\n".join(f"  {i} [{_layer_name(i.source)} -> {_layer_name(i.target)}]" for i in bad)
    assert not bad, (
        f"{len(bad)} import(s) run up the layers {' < '.join(LAYERS)} < top level "
        f"(docs/architecture.md, Import direction):\n{detail}"
    )


def test_the_engine_never_imports_the_trainer() -> None:
    """What runs in the engine's processes loads nothing of the trainer's (``vllm serve`` and every vLLM worker
    import ``engine/``)."""
    bad = [
        i
        for i in _hwsync_imports()
        if _within(i.source, ("hwsync.engine",)) and _within(i.target, ("hwsync.trainer", "hwsync.integrations"))
    ]
    assert not bad, _report(bad, "engine/ never imports trainer/ (nor integrations/)")


def test_no_folder_cycles() -> None:
    """No cycle among the folders of hwsync's top level (common, patches, engine, trainer, integrations, testing, the
    top-level modules): an edge from the folder of every importing module to the folder of what it imports."""
    edges: dict[str, set[str]] = {}
    for i in _hwsync_imports():
        a, b = _house_folder(i.source), _house_folder(i.target)
        edges.setdefault(a, set())
        edges.setdefault(b, set())
        if a != b:
            edges[a].add(b)
    cycles = _cycles(edges)
    detail = []
    for c in cycles:
        members = set(c)
        detail.append(
            f"  {', '.join(c)}\n"
            + "\n".join(
                f"    {i}"
                for i in _hwsync_imports()
                if _house_folder(i.source) in members
                and _house_folder(i.target) in members
                and _house_folder(i.source) != _house_folder(i.target)
            )
        )
    assert not cycles, "folder cycles:\n" + "\n".join(detail)


def test_no_subfolder_cycles_between_the_layer_folders_packages() -> None:
    """No cycle among the packages below a layer folder (``engine.vllm``, ``engine.names``, ``integrations.swift``,
    ``common.transport``, ...) counted apart from the modules at their layer folder's own level."""
    edges: dict[str, set[str]] = {}
    for i in _hwsync_imports():
        a, b = _folder(i.source), _folder(i.target)
        if a.count(".") < 2 or b.count(".") < 2:  # the layer folders' own modules: the folder rule above
            continue
        edges.setdefault(a, set())
        edges.setdefault(b, set())
        if a != b:
            edges[a].add(b)
    cycles = _cycles(edges)
    assert not cycles, f"cycles among sub-packages: {cycles}"


def test_public_faces_only_re_export() -> None:
    """A public face holds a docstring, imports and ``__all__``, nothing else: the code lives in the layer folders."""
    bad = []
    for face in PUBLIC_FACES:
        tree = ast.parse(MODULES[face].read_text())
        for k, node in enumerate(tree.body):
            docstring = (
                k == 0
                and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            )
            all_ = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
            imports = (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("hwsync.")
                and _layer(node.module or "") < TOP
            )
            if not (docstring or all_ or imports):
                bad.append(f"{MODULES[face].relative_to(ROOT)}:{node.lineno} {type(node).__name__}")
    assert not bad, (
        "public faces hold something besides a docstring, imports from the layer folders and "
        "__all__:\n  " + "\n  ".join(bad)
    )


def test_only_the_vllm_package_and_the_listed_modules_import_vllm() -> None:
    bad = [
        i
        for i in IMPORTS
        if i.target.split(".")[0] in ("vllm", "vllm_ascend") and not _within(i.source, list(VLLM_IMPORTERS))
    ]
    assert not bad, _report(bad, "only hwsync/engine/vllm/ and the modules listed with their reason import vLLM")


def test_device_and_framework_libraries_stay_in_their_folder() -> None:
    bad = [
        i
        for i in IMPORTS
        if i.target.split(".")[0] in LIBRARY_OWNERS and not _within(i.source, LIBRARY_OWNERS[i.target.split(".")[0]])
    ]
    assert not bad, _report(
        bad, "a device library only in its backend's folder, a trainer framework only in its integration package"
    )


def test_transport_and_patches_are_leaves() -> None:
    bad = [
        i
        for i in IMPORTS
        if i.target.startswith("hwsync")
        and (
            _within(i.source, ("hwsync.common.transport",))
            and not _within(i.target, TRANSPORT_MAY_IMPORT)
            or _within(i.source, ("hwsync.patches",))
            and not _within(i.target, PATCHES_MAY_IMPORT)
        )
    ]
    assert not bad, _report(bad, "transport imports only wire and errors; patches import no sync code")


def test_the_doc_lists_the_same_vllm_importers() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [m for m in VLLM_IMPORTERS if f"`{m.replace('.', '/')}" not in doc]
    assert not missing, f"docs/architecture.md does not name these vLLM importers: {missing}"


PRIVATE_IMPORTS_LEFT: set[tuple[str, str]] = set()
"""Private names imported across modules: 19 before issue 30, none now; this set stays empty."""


def test_no_private_names_across_modules() -> None:
    """``from hwsync.x import _name`` from another module is an undeclared interface: make it public or keep it
    inside its module."""
    found: set[tuple[str, str]] = set()
    where: dict[tuple[str, str], str] = {}
    for module, file in MODULES.items():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = next(
                _targets(module, file, ast.ImportFrom(module=node.module, names=[ast.alias("_")], level=node.level))
            )
            if _known(base) not in MODULES or _known(base) == module:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    key = (module, f"{base}.{a.name}")
                    found.add(key)
                    where[key] = f"{file.relative_to(ROOT)}:{node.lineno}"
    new = sorted(found - PRIVATE_IMPORTS_LEFT)
    assert not new, "private names imported from another module:\n" + "\n".join(f"  {where[k]} {k[1]}" for k in new)


def test_vllm_serves_middleware_loads_nothing_of_the_trainer() -> None:
    """``vllm serve``'s API server process (hwsync's middleware reading its server options) loads the engine side
    only: nothing under ``hwsync.trainer`` (the planner, verify and their imports) in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import hwsync.integrations.vllm_serve\n"
        "from hwsync.integrations.options import SyncOptions\n"
        "o = SyncOptions.server_from_env({'HWSYNC_SERVER': '127.0.0.1:5555', 'HWSYNC_TOKEN': 't' * 32})\n"
        "assert o.server == '127.0.0.1:5555' and o.token\n"
        "print(sorted(m for m in sys.modules if m.startswith('hwsync.trainer')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"vllm serve's process loads the trainer side: {out.stdout.strip()}"


WRAPPER_MARKS = {"_hwsync_guarded", "_hwsync_closed"}
"""Marks on the wrappers hwsync installs (its own functions; hwsync.common.foreign says why they are not state)."""


def test_state_about_foreign_objects_has_one_home() -> None:
    """hwsync keeps what it knows about another library's object in one place (:mod:`hwsync.common.foreign`): no
    module outside it sets an ``_hwsync_*`` attribute or ``__dict__`` key on an object that is not its own (``self``
    / ``cls``: hwsync's classes and its subclasses of the trainers'), wrapper marks aside."""
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.name == "foreign.py" and file.parent.name == "common":
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_hwsync_")
                and node.attr not in WRAPPER_MARKS
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{file.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("_hwsync_")
                and node.value not in WRAPPER_MARKS
            ):
                found.append(f"{file.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, "hwsync state on foreign objects outside hwsync.common.foreign.state_of:\n" + "\n".join(found)
