"""vLLM general plugin (entry point ``vllm.general_plugins: hwsync``): loaded by vLLM in every process it starts.

It installs, process-wide, the hwsync patches whose probes find their upstream bug on this vLLM and that must be in
place before an engine is built (e.g. ``vllm_cpu_moe_lora``: MoE + ``enable_lora`` on the CPU build). Patches the
sync receiver holds only around its own reloads (``vllm_cpu_moe_prepack``, ``vllm_cpu_mamba_conv``,
``vllm_reload_partial_loader``) are left to it, so
``HWSYNC_DISABLE_PATCHES`` keeps working per sync. It also registers hwsync's weight-transfer backend
(``weight_transfer_config={"backend": "hwsync"}``, :mod:`hwsync.engine.vllm.weight_transfer`) where vLLM has the API
(0.30+). Nothing else happens at import: the worker extension is opt-in
(``worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension"``), and ``hwsync.sync`` works without it in-process. Select
plugins with ``VLLM_PLUGINS`` (e.g. ``VLLM_PLUGINS=hwsync``); set ``HWSYNC_DISABLE_PATCHES=name,...`` to skip some.
"""

from __future__ import annotations

import logging

__all__ = ["register", "register_weight_transfer", "engine_patches", "RECEIVER_SCOPED"]

logger = logging.getLogger("hwsync")

RECEIVER_SCOPED = frozenset({"vllm_cpu_moe_prepack", "vllm_cpu_mamba_conv", "vllm_reload_partial_loader"})
"""Patches :mod:`hwsync.engine.vllm.applier` holds for the duration of each reload instead of process-wide."""


def engine_patches() -> list[str]:
    """Names of the patches the plugin installs: what ``hwsync.patches.apply()`` selects by default (opt-in
    integration patches, e.g. ms-swift's rollout server, stay with their integration) minus :data:`RECEIVER_SCOPED`."""
    import hwsync.patches as patches

    return [n for n in patches.names() if not getattr(patches.get(n), "opt_in", False) and n not in RECEIVER_SCOPED]


def register() -> list[str]:
    """Install the engine-side hwsync patches whose probes apply (idempotent); return the active names."""
    import hwsync.patches as patches

    active = patches.apply(engine_patches())
    register_weight_transfer()
    if active:
        logger.info("hwsync vLLM plugin: patches active: %s", ", ".join(active))
    return active


def register_weight_transfer() -> bool:
    """Register the ``"hwsync"`` weight-transfer backend in vLLM's factory
    (:mod:`hwsync.engine.vllm.transfer_registry`)."""
    from hwsync.engine.vllm.transfer_registry import register as register_backend

    return register_backend()
