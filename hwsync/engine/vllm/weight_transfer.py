"""hwsync as a vLLM weight-transfer backend (engine side): ``LLM(..., weight_transfer_config={"backend": "hwsync"})``.

vLLM (0.30+: ``vllm.distributed.weight_transfer``) drives every backend through the same worker methods:
``init_weight_transfer_engine(init_info)``, ``start_weight_update()``, ``update_weights(update_info)`` (once or more),
``finish_weight_update()``. This backend runs hwsync's own receiver and applier (:mod:`hwsync.engine.receiver`,
:mod:`hwsync.engine.vllm.applier`) behind them, so every rule of a colocated ``hwsync.sync`` holds: the manifest is
validated before anything is written, an interrupted update leaves the engine stale, versions only go forward, and the
strategies (full / adapter / hybrid, the adapter installed by hwsync from memory) are the same code.

What vLLM's protocol does not carry, and how it travels instead (the way vLLM's own backends carry theirs, in the
backend-specific ``update_info`` dict, :class:`HwsyncUpdateInfo`):

* the **manifest** (names, shapes, dtypes, buckets, version, strategy, the adapter's config): ``update_info
  ["manifest"]``, hwsync's JSON; one ``update_weights`` call is one whole hwsync sync (vLLM's start/finish only
  bracket it);
* the **tensors**: ``update_info["buckets"]``, an iterable of tensor lists handed over by reference (in-process
  worker: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as hwsync's colocated path). JSON over vLLM's HTTP routes cannot
  carry them: that case is refused with one error (hwsync's authenticated ``hwsync.serve`` is the server path);
* the **abort**: the bucket iterable raising (the trainer's ``progress`` callback, a failed producer); the receiver
  then leaves the engine as before (nothing reached a loader) or stale;
* the **adapter install**: inside the same update (the manifest's LoRA entries), validated and swapped in atomically
  by hwsync's applier. vLLM's worker resets LoRA state after every ``finish_weight_update`` (it assumes the base changed
  behind the LoRA manager's back), which would drop the adapter hwsync just installed; hwsync's receiver already keeps
  LoRA state exact (a base reload goes through vLLM's ``reload_weights``, whose own reset runs before the install).
  vLLM offers no opt-out, so the ledgered patch ``vllm_weight_transfer_lora_reset`` (opt-in, held from
  ``init_transfer_engine`` until ``shutdown``) skips that one reset after an update this backend completed
  (:data:`hwsync.patches.vllm_weight_transfer_lora_reset.KEEP_HOOK`). Where the patch is switched off
  (``HWSYNC_DISABLE_PATCHES``) an update carrying LoRA is refused before anything is written.

vLLM's factory hands a backend the model (``create_engine(config, vllm_config, device, model)``), not the worker;
hwsync's applier needs the worker's model runner (vLLM's reload, the LoRA manager). hwsync's receiver registers the
model it serves when it is created on a worker (:func:`hwsync.engine.vllm.worker.worker_of_model`: a weak map keyed by
that model), and the trainer-side handle (:class:`hwsync.trainer.transfer_backend.TransferBackendEngine`) creates it on
every worker before it calls ``init_weight_transfer_engine``; an engine no hwsync receiver serves refuses
``init_transfer_engine`` with one error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from hwsync.common.errors import SyncError

__all__ = ["HwsyncInitInfo", "HwsyncUpdateInfo", "HwsyncWeightTransferEngine"]

logger = logging.getLogger("hwsync.weight_transfer")

PROTOCOL = 1
"""Version of what :class:`HwsyncUpdateInfo` carries; the trainer side sends it at init."""


@dataclass
class HwsyncInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s info: the protocol the trainer speaks (nothing to rendezvous colocated)."""

    protocol: int = PROTOCOL


@dataclass
class HwsyncUpdateInfo(WeightTransferUpdateInfo):
    """One hwsync sync: its manifest (JSON) and its buckets (in-process tensor lists, manifest bucket order)."""

    manifest: str = ""
    buckets: Any = None


class HwsyncWeightTransferEngine(WeightTransferEngine[HwsyncInitInfo, HwsyncUpdateInfo]):
    """vLLM's ``WeightTransferEngine`` over hwsync's receiver (see the module docstring for what rides where)."""

    init_info_cls = HwsyncInitInfo
    update_info_cls = HwsyncUpdateInfo
    supports_draft_weight_update = False  # hwsync's receiver writes the served model only

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._completed: int | None = None  # version of the sync completed in the current session
        self._release: Any = None  # weakref.finalize releasing the LoRA-reset patch (held while in use)

    # -- vLLM's protocol ------------------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: HwsyncInitInfo) -> None:
        if init_info.protocol != PROTOCOL:
            raise SyncError(
                f"the trainer speaks hwsync weight-transfer protocol {init_info.protocol}, this engine "
                f"{PROTOCOL}: install the same hwsync version on both sides"
            )
        self._worker()
        self._hold_patch()

    def start_weight_update(self) -> None:
        self._completed = None
        self._worker()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # vLLM's default synchronizes unconditionally (no accelerator on CPU)
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: HwsyncUpdateInfo) -> None:
        from hwsync.common.wire import Manifest
        from hwsync.engine.vllm import worker as hw_worker

        self._completed = None
        if not update_info.manifest:
            raise SyncError(
                "hwsync update_info carries no manifest: drive this backend with "
                "hwsync.trainer.transfer_backend.TransferBackendEngine (or hwsync.sync on it)"
            )
        buckets = update_info.buckets
        # Limitation L8 (docs/limitations.md): tensors travel by reference, in-process engines only
        if buckets is None or isinstance(buckets, (str, bytes, dict)) or not isinstance(buckets, Iterable):
            raise SyncError(
                "hwsync update_info carries no in-process buckets (JSON, e.g. over vLLM's HTTP routes, cannot carry "
                "tensors): run the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) or use hwsync's "
                "authenticated server (hwsync.serve / hwsync.connect) for an engine in another process"
            )
        worker = self._worker()
        manifest = Manifest.from_json(update_info.manifest)
        if manifest.lora_specs and not self._keeps_adapters():
            raise SyncError(
                "this update carries a LoRA adapter, but vLLM's finish_weight_update would drop it right after "
                "(Worker.finish_weight_update -> model_runner.reset_lora_state) and the patch "
                "vllm_weight_transfer_lora_reset that keeps it is not active ("
                + self._patch_state()
                + "); nothing was written. Sync adapters with hwsync.sync(llm, model) on the "
                "engine itself, or enable the patch"
            )
        hw_worker.check_awake(hw_worker.unwrap_worker(worker), "hwsync update_weights")
        result = hw_worker.receive(worker, manifest, _checked(buckets))
        self._completed = int(result["version"])

    def finish_weight_update(self) -> None:
        """Nothing left to apply: the receiver completed the sync inside ``update_weights``. vLLM's worker resets
        LoRA state right after this returns; :meth:`hwsync_keeps_lora_state` tells the ledgered patch to skip it."""

    def hwsync_keeps_lora_state(self) -> bool:
        """Asked by ``vllm_weight_transfer_lora_reset`` as vLLM's worker finishes a session: True only when this
        session's update completed (hwsync's receiver left LoRA state exact). Consumed: one answer per session."""
        done, self._completed = self._completed is not None, None
        return done

    def shutdown(self) -> None:
        self._completed = None
        release, self._release = self._release, None
        if release is not None:
            release()

    # -- helpers --------------------------------------------------------------------------------------------------
    def _worker(self) -> Any:
        """The worker whose hwsync receiver serves the model vLLM handed this engine
        (:func:`hwsync.engine.vllm.worker.worker_of_model`)."""
        from hwsync.engine.vllm.worker import worker_of_model

        worker = worker_of_model(self.model)
        if worker is None:
            raise SyncError(
                "hwsync weight transfer: no hwsync receiver serves this engine's model yet. Drive the engine with "
                "hwsync.sync(llm, model) (its handle, hwsync.as_engine(llm), attaches hwsync's receiver to every "
                "worker before vLLM's init_weight_transfer_engine), or call the worker extension's hwsync_state first"
            )
        return worker

    def _hold_patch(self) -> None:
        """Hold ``vllm_weight_transfer_lora_reset`` while this engine is in use (idempotent; released by
        :meth:`shutdown` or when vLLM drops the engine)."""
        import hwsync.patches as patches

        if self._release is not None:
            return
        self._release, _ = patches.hold("vllm_weight_transfer_lora_reset", self)  # not held: probe not needed
        if "vllm_weight_transfer_lora_reset" in patches.disabled():  # (vLLM keeps LoRA state) or target moved
            logger.warning(
                "hwsync weight transfer: patch vllm_weight_transfer_lora_reset is switched off "
                "(HWSYNC_DISABLE_PATCHES): updates carrying a LoRA adapter are refused"
            )

    def _keeps_adapters(self) -> bool:
        import hwsync.patches as patches

        patch = patches.get("vllm_weight_transfer_lora_reset")
        state = patch.probe().state
        return patch.active if state == patches.APPLIES else state == patches.NOT_NEEDED  # NOT_NEEDED: vLLM keeps it

    def _patch_state(self) -> str:
        import hwsync.patches as patches

        patch = patches.get("vllm_weight_transfer_lora_reset")
        if patch.name in patches.disabled():
            return "switched off by HWSYNC_DISABLE_PATCHES"
        return f"{patch.probe().state}: {patch.probe().reason}"


def _checked(buckets: Iterable[Sequence[Tensor]]) -> Iterable[Sequence[Tensor]]:
    """The buckets as the receiver reads them, refusing anything that is not a list of tensors."""
    for bucket in buckets:
        if not all(isinstance(t, Tensor) for t in bucket):
            raise SyncError("hwsync update_info buckets must be lists of tensors")
        yield bucket
