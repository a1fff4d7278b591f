"""Installing hwsync into ms-swift: one registry entry plus the probe-gated patches, all undoable.

ms-swift builds its trainer from the dotted path ``TrainerFactory.TRAINER_MAPPING[rlhf_type]``; pointing the
``"grpo"`` entry at :class:`hwsync.integrations.swift._trainer.HwsyncGRPOTrainer` (a ``GRPOTrainer`` subclass) is all it
takes to route every weight sync of ``swift rlhf --rlhf_type grpo`` through hwsync. No ms-swift function is
replaced. The entry is a string, so installing imports neither the trainer nor vLLM. Server mode additionally
needs ``swift rollout`` to hand its engine to hwsync's sync server: the patch ``swift_rollout_serve`` (applied only
when ``HWSYNC_SERVER`` is set; see :mod:`hwsync.integrations.swift._server`).
"""

from __future__ import annotations

import os
import threading

from hwsync.common.errors import PluginError
from hwsync.integrations.swift._options import ENV

__all__ = ["PluginError", "install", "uninstall", "installed", "TRAINER", "RLHF_TYPE"]

RLHF_TYPE = "grpo"
INTEGRATION = "swift"
"""The ``integration`` of the opt-in patches this plugin applies in server mode (``swift rollout``)."""
TRAINER = "hwsync.integrations.swift._trainer.HwsyncGRPOTrainer"

_lock = threading.Lock()
_previous: str | None = None
_our_patches: list[str] = []


def _mapping() -> dict[str, str]:
    try:
        from swift.trainers import TrainerFactory
    except ImportError as e:
        raise PluginError(f"hwsync.swift needs ms-swift ({e}): pip install 'hwsync[swift]' (ms-swift==4.6.0)") from e
    mapping = getattr(TrainerFactory, "TRAINER_MAPPING", None)
    if not isinstance(mapping, dict) or RLHF_TYPE not in mapping:
        import swift

        raise PluginError(
            f"ms-swift {getattr(swift, '__version__', '?')} has no TrainerFactory.TRAINER_MAPPING['{RLHF_TYPE}'], "
            "the hook hwsync registers its trainer in; hwsync.swift is tested with ms-swift 4.6.0"
        )
    return mapping


def install(*, patches: bool = True) -> None:
    """Route ms-swift's GRPO weight sync through hwsync and apply the patches whose probes fire. Idempotent."""
    global _previous
    with _lock:
        mapping = _mapping()
        if patches:
            import hwsync.patches as hp
            from hwsync.engine.vllm_plugin import engine_patches
            from hwsync.patches import swift_rollout  # registers the swift_rollout_* patches

            before = {p.name for p in hp.registered() if p.installed}
            # what the vLLM plugin installs (opt-in patches left to whoever holds them, receiver-scoped ones to the
            # receiver), plus, in server mode, the opt-in patches of this integration (a property of each patch)
            wanted = engine_patches()
            if os.environ.get(ENV["server"]):  # colocate: do not even import swift's rollout server module
                from hwsync.integrations.swift._server import keep_engine_in_process, serve_rollout_engine

                swift_rollout.serve_with(keep_engine_in_process, serve_rollout_engine)
                wanted += [p.name for p in hp.registered() if p.opt_in and p.integration == INTEGRATION]
            _our_patches.extend(n for n in hp.apply(wanted) if n not in before and n not in _our_patches)
        if mapping[RLHF_TYPE] != TRAINER:
            _previous = mapping[RLHF_TYPE]
            mapping[RLHF_TYPE] = TRAINER


def uninstall() -> None:
    """Undo :func:`install`: ms-swift's own trainer again, and the patches hwsync installed removed."""
    global _previous
    with _lock:
        mapping = _mapping()
        if mapping.get(RLHF_TYPE) == TRAINER and _previous is not None:  # someone else's entry stays theirs
            mapping[RLHF_TYPE] = _previous
        _previous = None
        if _our_patches:
            import hwsync.patches as hp

            for name in reversed(_our_patches):
                hp.get(name).uninstall()
            _our_patches.clear()


def installed() -> bool:
    """Whether ``swift rlhf --rlhf_type grpo`` currently builds hwsync's trainer."""
    return _mapping().get(RLHF_TYPE) == TRAINER
