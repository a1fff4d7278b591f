"""The patch mechanism: probe-gated, scoped or process-wide, reference-counted, exactly reversible.

A :class:`Patch` replaces one or more attributes (``"module:Qual.attr"``; a class method, a module function, ...)
with wrappers built by :meth:`Patch.replacement` from the object found there. It is applied only when
:meth:`Patch.probe` finds the upstream bug on the installed version (``force=True`` overrides that, for tests),
and it is undone exactly: the very object that was there before goes back (an inherited method is un-shadowed,
not copied down), even when the body of a ``with`` block raises.

Scopes and process-wide installs share one reference count, so nesting and double installs patch once. When
another library patched the same attribute after us, removing ours would silently remove theirs too: we leave
the attribute alone and emit a :class:`PatchWarning` (recorded in :attr:`Patch.shadowed`).

Nothing here imports a patch's target until the patch is probed or applied.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from hwsync.common.errors import PatchError
from hwsync.common.quiet import quiet_imports

__all__ = [
    "APPLIES",
    "NOT_NEEDED",
    "TARGET_MISSING",
    "Patch",
    "PatchStatus",
    "PatchWarning",
    "ProbeResult",
    "State",
    "TargetMissing",
    "resolve_target",
]

State = Literal["applies", "not needed", "target missing"]
APPLIES: State = "applies"
NOT_NEEDED: State = "not needed"
TARGET_MISSING: State = "target missing"
_STATES = (APPLIES, NOT_NEEDED, TARGET_MISSING)

_MISSING = object()
# Marker attribute set on every wrapper we install (where the object accepts attributes): the patch name.
WRAPPER_MARK = "__hwsync_patch__"


class PatchWarning(UserWarning):
    """A patch could not be undone exactly because someone else patched the same attribute on top of it."""


class TargetMissing(LookupError):
    """A patch target (module, class or attribute) does not exist in the installed version."""


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found: ``applies`` (bug present), ``not needed`` (fixed / not affected), ``target missing``."""

    state: State
    reason: str

    def __post_init__(self) -> None:
        if self.state not in _STATES:
            raise ValueError(f"ProbeResult.state must be one of {_STATES}, got {self.state!r}")


@dataclass(frozen=True)
class PatchStatus:
    """One row of ``hwsync doctor``'s patch table."""

    name: str
    target: str
    state: State
    reason: str
    installed: bool
    upstream: str = ""


@dataclass(frozen=True)
class ResolvedTarget:
    """A target located in the live process: ``owner.attr`` currently holds ``original``."""

    spec: str
    owner: Any  # module or class
    attr: str
    own: bool  # the attribute lives in owner.__dict__ (False: inherited through a class's MRO)
    original: Any  # the raw object (for classes: the descriptor itself, e.g. a classmethod object)


def _import(module_name: str) -> Any:
    try:
        with quiet_imports():  # a probe's import: the upstream library's import-time lines are not hwsync's news
            return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        if e.name == top:
            raise TargetMissing(f"{top} is not installed") from e
        raise TargetMissing(f"module {module_name} is not importable ({e})") from e
    except ImportError as e:
        raise TargetMissing(f"module {module_name} is not importable ({e})") from e
    except Exception as e:  # a broken optional install (e.g. vllm_ascend without torch_npu) raises anything
        raise TargetMissing(f"module {module_name} fails to import ({type(e).__name__}: {e})") from e


def resolve_target(spec: str) -> ResolvedTarget:
    """Locate ``"package.module:Qual.attr"``; raise :class:`TargetMissing` naming the missing piece."""
    module_name, sep, qual = spec.partition(":")
    if not sep or not module_name or not qual:
        raise PatchError(f"bad patch target {spec!r}: write it as 'package.module:Class.attribute'")
    owner: Any = _import(module_name)
    *path, attr = qual.split(".")
    where = module_name
    for part in path:
        try:
            owner = getattr(owner, part)
        except AttributeError as e:
            raise TargetMissing(f"{where} has no attribute {part!r}") from e
        where = f"{where}.{part}"
    if isinstance(owner, type):
        try:
            original = inspect.getattr_static(owner, attr)
        except AttributeError as e:
            raise TargetMissing(f"{where} has no attribute {attr!r}") from e
        own = attr in owner.__dict__
    else:
        try:
            original = getattr(owner, attr)
        except AttributeError as e:
            raise TargetMissing(f"{where} has no attribute {attr!r}") from e
        own = True
    return ResolvedTarget(spec, owner, attr, own, original)


def _current(owner: Any, attr: str) -> Any:
    if isinstance(owner, type):
        return owner.__dict__.get(attr, _MISSING)
    return getattr(owner, attr, _MISSING)


def _mark(obj: Any, name: str) -> None:
    for target in (obj, getattr(obj, "__func__", None)):
        if target is None:
            continue
        with contextlib.suppress(AttributeError, TypeError):
            setattr(target, WRAPPER_MARK, name)


def _marked(obj: Any) -> str | None:
    for target in (obj, getattr(obj, "__func__", None)):
        mark = getattr(target, WRAPPER_MARK, None) if target is not None else None
        if isinstance(mark, str):
            return mark
    return None


class _Scope:
    """``with patch.scoped(force=...):`` -- holds one reference for the duration of the block."""

    def __init__(self, patch: Patch, force: bool) -> None:
        self._patch, self._force, self._held = patch, force, False

    def __enter__(self) -> Patch:
        self._held = self._patch._acquire(self._force)
        return self._patch

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self._held = False
            self._patch._release()


class Patch:
    """One upstream bug, fixed by replacing one or more attributes. Subclass and register an instance.

    Class attributes to set:

    * ``name`` -- registry key, also the ledger section (``hwsync/patches/README.md``);
    * ``targets`` -- ``"module:Qual.attr"`` strings; an entry may be a tuple of alternatives (the first that
      exists is used: the same function moved between upstream releases);
    * ``upstream`` -- issue / PR URL; ``seen_in`` -- versions where the bug was observed;
    * ``remove_when`` -- the condition that retires the patch.

    Methods to implement: :meth:`check` (the probe proper; targets are known to exist when it runs; read the
    unpatched behaviour through :meth:`original`) and :meth:`replacement`.
    """

    name: ClassVar[str] = ""
    targets: ClassVar[tuple[str | tuple[str, ...], ...]] = ()
    upstream: ClassVar[str] = ""
    seen_in: ClassVar[tuple[str, ...]] = ()
    remove_when: ClassVar[str] = ""
    # opt_in patches are left out of ``apply()`` with no names, hence out of what ``hwsync.engine.vllm_plugin``
    # (every vLLM process) and ``hwsync.swift`` install process-wide: the hwsync code that needs one holds it (scoped,
    # e.g. per worker), or the integration named by ``integration`` applies it.
    opt_in: ClassVar[bool] = False
    # the integration that applies an opt-in patch by this property (e.g. "swift": hwsync.swift installs those in
    # server mode); "" for patches held by hwsync's own code (the receiver, the backend, a trainer) or not opt-in
    integration: ClassVar[str] = ""

    def __init__(self) -> None:
        if not self.name or not self.targets:
            raise PatchError(f"{type(self).__name__} must define `name` and `targets`")
        self._lock = threading.RLock()
        self._refs = 0
        self._process_wide = False
        self._applied: list[tuple[ResolvedTarget, Any]] = []  # (target, our wrapper or None = not ours)
        self._probe: ProbeResult | None = None
        self._local = threading.local()
        self.shadowed: list[str] = []

    # -- to implement ----------------------------------------------------------------------------------------------
    def check(self) -> ProbeResult:
        """Detect the bug on the installed version (behavioural where cheap, else by version)."""
        raise NotImplementedError

    def replacement(self, original: Any, target: str) -> Any:
        """The object to install at ``target`` (one of the resolved specs) in place of ``original``."""
        raise NotImplementedError

    # -- introspection ---------------------------------------------------------------------------------------------
    @property
    def target(self) -> str:
        """Human-readable target list (alternatives joined with ``|``)."""
        return ", ".join(t if isinstance(t, str) else " | ".join(t) for t in self.targets)

    @property
    def active(self) -> bool:
        """True while our wrappers are installed (by a scope or process-wide)."""
        return self._refs > 0

    @property
    def installed(self) -> bool:
        """True while installed process-wide (``install()`` without a matching ``uninstall()``)."""
        return self._process_wide

    def resolve(self) -> list[ResolvedTarget]:
        """Locate every target now; raises :class:`TargetMissing` for the first missing one."""
        out = []
        for entry in self.targets:
            alternatives = (entry,) if isinstance(entry, str) else tuple(entry)
            errors: dict[str, list[str]] = {}
            for spec in alternatives:
                try:
                    out.append(resolve_target(spec))
                    break
                except TargetMissing as e:
                    errors.setdefault(str(e), []).append(spec)
            else:
                if len(errors) == 1:  # one cause (one candidate, or all missing for the same reason)
                    raise TargetMissing(next(iter(errors)))
                raise TargetMissing("; ".join(f"{' | '.join(specs)}: {msg}" for msg, specs in errors.items()))
        return out

    def original(self, index: int = 0) -> Any:
        """The unpatched object at target ``index`` (the saved original while we are installed)."""
        with self._lock:
            if self._applied:
                return self._applied[index][0].original
        return self.resolve()[index].original

    def original_source(self, index: int = 0) -> str | None:
        """The source of the unpatched function at target ``index`` (a method's function), ``None`` where Python
        cannot read it: what source-level probes search."""
        original = self.original(index)
        try:
            return inspect.getsource(getattr(original, "__func__", original))
        except (OSError, TypeError):
            return None

    def probe(self, refresh: bool = False) -> ProbeResult:
        """Probe once per process (cached; ``refresh=True`` re-runs). Never raises."""
        with self._lock:
            if self._probe is not None and not refresh:
                return self._probe
            try:
                self.resolve()
            except TargetMissing as e:
                result = ProbeResult(TARGET_MISSING, str(e))
            else:
                try:
                    result = self.check()
                except Exception as e:  # a probe must never break the doctor or a plugin
                    result = ProbeResult(
                        NOT_NEEDED,
                        f"probe error ({type(e).__name__}: {e}); left unpatched -- install(force=True) overrides",
                    )
            self._probe = result
            return result

    def status(self) -> PatchStatus:
        result = self.probe()
        return PatchStatus(self.name, self.target, result.state, result.reason, self.active, self.upstream)

    # -- applying --------------------------------------------------------------------------------------------------
    def install(self, force: bool = False) -> bool:
        """Install process-wide (for plugins). Idempotent. Returns whether the patch is active afterwards."""
        with self._lock:
            if self._process_wide:
                return True
            if self._acquire(force):
                self._process_wide = True
            return self._process_wide

    def uninstall(self) -> bool:
        """Undo :meth:`install`; the wrappers go once no scope holds them. Returns whether it was installed."""
        with self._lock:
            if not self._process_wide:
                return False
            self._process_wide = False
            self._release()
            return True

    def scoped(self, force: bool = False) -> _Scope:
        """A context manager holding the patch for one block (a no-op where the probe says it is not needed)."""
        return _Scope(self, force)

    def __enter__(self) -> Patch:
        scope = self.scoped()
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(scope)
        try:
            return scope.__enter__()
        except BaseException:
            stack.pop()
            raise

    def __exit__(self, *exc: object) -> None:
        self._local.stack.pop().__exit__(*exc)

    def _acquire(self, force: bool) -> bool:
        with self._lock:
            if self._refs == 0:
                if not force:
                    result = self.probe()
                    if result.state != APPLIES:
                        return False
                self._apply()
            self._refs += 1
            return True

    def _release(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise PatchError(f"patch {self.name!r} released more often than acquired")
            self._refs -= 1
            if self._refs == 0:
                self._restore()

    def _apply(self) -> None:
        try:
            resolved = self.resolve()
        except TargetMissing as e:
            raise PatchError(f"cannot apply patch {self.name!r}: {e}") from e
        done: list[tuple[ResolvedTarget, Any]] = []
        try:
            for target in resolved:
                if _marked(target.original) == self.name:
                    # Another copy of this patch (hwsync imported twice?) already wraps it: do not wrap twice,
                    # and do not restore what we did not install.
                    done.append((target, None))
                    continue
                wrapper = self.replacement(target.original, target.spec)
                _mark(wrapper, self.name)
                setattr(target.owner, target.attr, wrapper)
                done.append((target, wrapper))
        except BaseException as e:
            for target, wrapper in reversed(done):
                if wrapper is not None:
                    self._put_back(target, wrapper)
            if isinstance(e, Exception) and not isinstance(e, PatchError):
                raise PatchError(
                    f"applying patch {self.name!r} failed ({type(e).__name__}: {e}); nothing was left patched"
                ) from e
            raise
        self._applied = done

    def _restore(self) -> None:
        applied, self._applied = self._applied, []
        for target, wrapper in reversed(applied):
            if wrapper is not None:
                self._put_back(target, wrapper)

    def _put_back(self, target: ResolvedTarget, wrapper: Any) -> None:
        current = _current(target.owner, target.attr)
        if current is not wrapper:
            now = (
                "deleted" if current is _MISSING else f"now {getattr(current, '__qualname__', type(current).__name__)}"
            )
            self.shadowed.append(target.spec)
            warnings.warn(
                f"hwsync patch {self.name!r}: {target.spec} was replaced after hwsync patched it ({now}); "
                "leaving it in place (restoring would undo the other change). hwsync's wrapper may still run "
                "underneath it.",
                PatchWarning,
                stacklevel=4,
            )
            return
        if target.own:
            setattr(target.owner, target.attr, target.original)
        else:
            delattr(target.owner, target.attr)

    def __repr__(self) -> str:
        return f"<Patch {self.name} active={self.active} installed={self.installed}>"


# ---------------------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, Patch] = {}


def register(patch: Patch) -> Patch:
    """Add ``patch`` to the registry (one instance per name)."""
    if patch.name in _REGISTRY and _REGISTRY[patch.name] is not patch:
        raise PatchError(f"a patch named {patch.name!r} is already registered")
    _REGISTRY[patch.name] = patch
    return patch


def registered() -> Iterator[Patch]:
    return iter(list(_REGISTRY.values()))


def lookup(name: str) -> Patch:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PatchError(f"no patch named {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def select(names: Sequence[str] | None) -> list[Patch]:
    if names is None:
        return [p for p in _REGISTRY.values() if not p.opt_in]
    if isinstance(names, str):
        names = [names]
    return [lookup(n) for n in names]
