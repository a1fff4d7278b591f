"""Registers hwsync's weight-transfer backend in vLLM's factory, lazily (vLLM imports
:mod:`hwsync.engine.vllm.weight_transfer` only when an engine selects ``"hwsync"``). A leaf: the vLLM plugin calls it in
every vLLM process, so it imports nothing of hwsync's."""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "hwsync"
_registered = False


def register() -> bool:
    """Register ``"hwsync"`` (idempotent); ``False`` where this vLLM has no ``vllm.distributed.weight_transfer``
    or the name was registered already (by this process's earlier call, or by another copy of hwsync)."""
    global _registered
    if _registered:
        return False
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("vllm"):
            return False  # no weight-transfer API: hwsync.sync / hwsync.serve still work
        raise
    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "hwsync.engine.vllm.weight_transfer", "HwsyncWeightTransferEngine"
        )
    except ValueError:  # "already registered": vLLM's registry refuses a second registration of a name
        _registered = True
        return False
    _registered = True
    return True
