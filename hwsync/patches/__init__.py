"""hwsync.patches: scoped, probe-gated, reversible fixes of upstream bugs (ledger: ``hwsync/patches/README.md``).

Every monkey-patch hwsync ships lives here, one module per patched target, each with the upstream issue it
works around and the condition that retires it. Nothing is patched at import: importing this package imports
neither transformers, PEFT nor vLLM. Typical use::

    import hwsync.patches as patches
    patches.apply()                       # process-wide, only what the probes ask for (plugins do this)
    with patches.get("peft_moe_regex"):   # or scoped to a block
        model = get_peft_model(model, config)
    for row in patches.status(): ...      # what `hwsync doctor` prints

Set ``HWSYNC_DISABLE_PATCHES=name,name`` (or ``all``) to keep :func:`apply` from installing some or any.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from hwsync.common.config import read

from ._base import (
    APPLIES,
    NOT_NEEDED,
    TARGET_MISSING,
    Patch,
    PatchStatus,
    PatchWarning,
    ProbeResult,
    State,
    TargetMissing,
    lookup,
    register,
    registered,
    select,
)

# One module per patched target; importing them only defines and registers the Patch objects.
# Imported in ledger order (the order `status()` and `hwsync doctor` list them).
from . import rope_config  # noqa: E402,F401  isort: skip
from . import peft_moe_regex  # noqa: E402,F401  isort: skip
from . import mtp_config  # noqa: E402,F401  isort: skip
from . import vllm_cpu_moe_lora  # noqa: E402,F401  isort: skip
from . import vllm_cpu_moe_prepack  # noqa: E402,F401  isort: skip
from . import vllm_cpu_mamba_conv  # noqa: E402,F401  isort: skip
from . import vllm_reload_partial_loader  # noqa: E402,F401  isort: skip
from . import vllm_cpu_lora_logits  # noqa: E402,F401  isort: skip
from . import vllm_transformers_backend  # noqa: E402,F401  isort: skip
from . import vllm_lora_expert_spellings  # noqa: E402,F401  isort: skip
from . import vllm_offline_failed_requests  # noqa: E402,F401  isort: skip
from . import vllm_moe_router_lora_alias  # noqa: E402,F401  isort: skip
from . import vllm_sleep_watch  # noqa: E402,F401  isort: skip  (opt_in: held by hwsync.engine.vllm.sleep.watch only)
from . import vllm_weight_transfer_lora_reset  # noqa: E402,F401  isort: skip  (opt_in: held by hwsync's backend only)
from . import vllm_lora_manager_guards  # noqa: E402,F401  isort: skip  (opt_in: held per worker by hwsync's receiver)
from . import vllm_ascend  # noqa: E402,F401  isort: skip
from . import swift_rollout  # noqa: E402,F401  isort: skip  (opt_in: applied by hwsync.integrations.swift only)
from . import trl_vllm_generation  # noqa: E402,F401  isort: skip  (opt_in: held by hwsync.integrations.trl.GRPOTrainer only)

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
    "apply",
    "disabled",
    "get",
    "hold",
    "names",
    "register",
    "remove_all",
    "status",
]

DISABLE_ENV = "HWSYNC_DISABLE_PATCHES"


def names() -> list[str]:
    """Registered patch names, in ledger order."""
    return [p.name for p in registered()]


def get(name: str) -> Patch:
    """The registered patch called ``name`` (usable as a context manager); :class:`PatchError` if unknown."""
    return lookup(name)


def disabled() -> set[str]:
    """Names switched off by ``HWSYNC_DISABLE_PATCHES`` (``all`` = every patch)."""
    raw = set(read(DISABLE_ENV))
    return set(names()) if "all" in raw else raw


def hold(
    name: str, owner: object, then: Callable[[], None] | None = None
) -> tuple[weakref.finalize[Any, Any] | None, str]:
    """Hold opt-in patch ``name`` for as long as ``owner`` lives (one scope reference, released when ``owner`` is
    collected, or early by calling the returned finalizer; ``then`` runs first). Returns that finalizer, or ``None``
    and why not where the patch is not in force (switched off by ``HWSYNC_DISABLE_PATCHES``, or its probe does not
    apply): nothing is held then."""
    if name in disabled():
        return None, f"switched off by {DISABLE_ENV}"
    patch = get(name)
    scope = patch.scoped()
    scope.__enter__()
    if not patch.active:
        scope.__exit__(None, None, None)
        return None, patch.probe().reason

    def release() -> None:
        if then is not None:
            then()
        scope.__exit__(None, None, None)

    return weakref.finalize(owner, release), ""


def apply(names: Sequence[str] | None = None, *, force: bool = False) -> list[str]:
    """Install process-wide every selected patch whose probe says it applies; return the active names.

    ``names=None`` selects all registered patches except the opt-in ones (``Patch.opt_in``: held by the hwsync code
    that needs them, e.g. the receiver's ``vllm_sleep_watch``, or applied by one integration, e.g. ms-swift's rollout
    server patches, ``Patch.integration == "swift"``); unknown names raise before anything is installed. Patches
    named in ``HWSYNC_DISABLE_PATCHES`` are skipped. ``force=True`` installs regardless of the probe (tests).
    """
    chosen = select(names)
    off = disabled()
    return [p.name for p in chosen if p.name not in off and p.install(force=force)]


def status() -> list[PatchStatus]:
    """Probe every registered patch (cached per process) and report state, reason and whether it is active."""
    return [p.status() for p in registered()]


def remove_all() -> list[str]:
    """Undo every process-wide install; return the names removed. Active ``with`` scopes keep their patches."""
    return [p.name for p in registered() if p.uninstall()]
