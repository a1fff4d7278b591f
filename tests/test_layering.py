"""The layering docs/architecture.md states ("Import direction"), read from the code: every ``import`` of every module
under ``hwsync/`` and ``patches/`` (= ``hwsync.patches``), at module level, under ``TYPE_CHECKING`` and inside
functions, parsed with :mod:`ast` (nothing is imported). A function-level import is still a dependency: it only
moves the failure from import time to call time.

Fails on an import cycle and on an import across a boundary; each failure names the importing file and line.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"hwsync": ROOT / "hwsync", "hwsync.patches": ROOT / "patches"}

TRAINER_SIDE = ("hwsync.api", "hwsync.payload", "hwsync.strategy", "hwsync.merged", "hwsync.gather",
                "hwsync.verify", "hwsync.report", "hwsync.server.client")
"""What runs in the trainer process to plan, produce and check a sync."""
ENGINE_SIDE = ("hwsync.receiver", "hwsync.vllm", "hwsync.vllm_plugin", "hwsync.server.server", "hwsync.names",
               "hwsync.patches")
"""What runs in the engine's processes (hwsync.vllm.local is the trainer's colocated handle, but it drives vLLM)."""

VLLM_IMPORTERS = {
    "hwsync.vllm": "everything hwsync does inside vLLM",
    "hwsync.patches": "each patch's target is an upstream library, vLLM's for most",
    "hwsync.capabilities": "probes the installed vLLM without an engine (version range, MoE-LoRA kernels) for "
                           "`hwsync doctor` and the version check",
    "hwsync.engine": "the handle's `lora_request` builds vLLM's LoRARequest where vLLM is importable (the report "
                     "carries it in both modes; a trainer without vLLM gets None)",
    "hwsync.names.namespace": "reads vLLM's own reload helpers to name what a layer's loader accepts",
    "hwsync.swift._engine_view": "the view on the vLLM engine ms-swift's rollout builds",
    "hwsync.testing": "builds real vLLM engines and references for the tests",
    "hwsync.server.vllm_api": "hwsync's sync server inside vLLM's own API server (`vllm serve`, `trl vllm-serve`): "
                              "the worker extension and the HTTP middleware are vLLM's",
    "hwsync.verify": "folds the LoRA scaling with vLLM's own LoRALayerWeights.optimize, so the adapter-content check "
                     "compares with what vLLM's own loading would hold (where vLLM is importable)",
}
"""Who may import ``vllm`` / ``vllm_ascend``, and why (docs/architecture.md lists the same)."""

LIBRARY_OWNERS = {
    "torch_npu": ("hwsync.npu",),
    "swift": ("hwsync.swift", "hwsync.patches.swift_rollout"),
    "trl": ("hwsync.trl", "hwsync.patches.trl_vllm_generation"),
}
"""A device library only in its backend's folder; a trainer framework only in its integration package (and the
patch of it)."""

TRANSPORT_MAY_IMPORT = ("hwsync.transport", "hwsync.wire", "hwsync.errors")
PATCHES_MAY_IMPORT = ("hwsync.patches", "hwsync.errors", "hwsync.quiet", "hwsync.npu.ascend_layouts")
"""Patches stay leaves: they fix upstream code and call none of hwsync's sync machinery (the vllm_ascend patch writes
vllm-ascend's processed expert layout, which lives with the NPU backend)."""


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
    for package, folder in PACKAGES.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = f
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
    """The hwsync module a dotted name lives in (``hwsync.wire.Manifest`` -> ``hwsync.wire``); others as they are."""
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
                    out.extend(Import(module, _known(t), file, child.lineno, in_function)
                               for t in _targets(module, file, child))
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
    return f"{len(bad)} import(s) break the rule '{rule}' (docs/architecture.md, Import direction):\n" + \
        "\n".join(f"  {i}" for i in bad)


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
        detail.append(f"  {len(c)} modules: " + ", ".join(c) + "\n" + "\n".join(
            f"    {i}" for i in IMPORTS if i.source in members and i.target in members))
    assert not cycles, "import cycles (module level and inside functions):\n" + "\n".join(detail)


def test_engine_side_never_imports_trainer_side() -> None:
    bad = [i for i in IMPORTS if _within(i.source, ENGINE_SIDE) and _within(i.target, TRAINER_SIDE)]
    assert not bad, _report(bad, "engine side never imports trainer side")


def test_server_never_imports_api() -> None:
    bad = [i for i in IMPORTS if _within(i.source, ("hwsync.server",)) and _within(i.target, ("hwsync.api",))]
    assert not bad, _report(bad, "server/* never imports api")


def test_only_the_vllm_package_and_the_listed_modules_import_vllm() -> None:
    bad = [i for i in IMPORTS if i.target.split(".")[0] in ("vllm", "vllm_ascend")
           and not _within(i.source, list(VLLM_IMPORTERS))]
    assert not bad, _report(bad, "only hwsync/vllm/ and the modules listed with their reason import vLLM")


def test_device_and_framework_libraries_stay_in_their_folder() -> None:
    bad = [i for i in IMPORTS if i.target.split(".")[0] in LIBRARY_OWNERS
           and not _within(i.source, LIBRARY_OWNERS[i.target.split(".")[0]])]
    assert not bad, _report(bad, "a device library only in its backend's folder, a trainer framework only in its "
                                 "integration package")


def test_transport_and_patches_are_leaves() -> None:
    bad = [i for i in IMPORTS if i.target.startswith("hwsync") and (
        _within(i.source, ("hwsync.transport",)) and not _within(i.target, TRANSPORT_MAY_IMPORT)
        or _within(i.source, ("hwsync.patches",)) and not _within(i.target, PATCHES_MAY_IMPORT))]
    assert not bad, _report(bad, "transport imports only wire and errors; patches import no sync code")


def test_the_doc_lists_the_same_vllm_importers() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [m for m in VLLM_IMPORTERS if f"`{m.replace('.', '/').replace('hwsync/patches', 'patches')}" not in doc]
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
            base = next(_targets(module, file, ast.ImportFrom(module=node.module, names=[ast.alias("_")],
                                                            level=node.level)))
            if _known(base) not in MODULES or _known(base) == module:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    key = (module, f"{base}.{a.name}")
                    found.add(key)
                    where[key] = f"{file.relative_to(ROOT)}:{node.lineno}"
    new = sorted(found - PRIVATE_IMPORTS_LEFT)
    assert not new, "private names imported from another module:\n" + "\n".join(f"  {where[k]} {k[1]}" for k in new)
