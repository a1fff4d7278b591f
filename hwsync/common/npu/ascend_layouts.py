"""vllm-ascend's expert layouts: which layout a MoE layer holds now, and weight loaders that write into it.

vllm-ascend's ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` turns vLLM's *preprocessed*
experts (w13 [E, 2I, H], w2 [E, H, I]) into the *processed* kernel layout (w13 [E, H, 2I], w2 [E, I, H]):

* released versions (0.13 .. 0.25) wrap the transposed data in a **new** ``nn.Parameter``: the
  ``weight_loader`` vLLM attached is gone, so any later ``load_weights`` fails;
* main keeps the loader (``replace_parameter``), but it is vLLM's loader, which writes checkpoint
  orientation: into the transposed storage it is wrong (or raises on a shape mismatch).

``NPUWorker.wake_up`` (0.13 .. 0.23) transposes MoE weights back to preprocessed, guessing from shapes
(``w2.shape[2] == hidden``, ``w13.shape[1] == hidden``) -- ambiguous when I == H or 2I == H -- and again wraps new
Parameters without loaders. What it leaves breaks the forward (the kernel reads processed weights: vllm-ascend
#12226), vLLM's layerwise ``reload_weights`` (it copies the re-processed experts into the Parameters it found:
a shape mismatch, vllm-ascend #5915) and, in a square case, a second wake_up (it transposes preprocessed experts).

hwsync therefore records the layout *on the Parameters* (:func:`expert_layout`, never guessed from shapes) and keeps
a loader that matches it: vLLM's own for preprocessed, :func:`processed_weight_loader` (built on
:func:`hwsync.common.layouts.copy_expert_shard_`) for processed. With a loader for the processed layout there is nothing
for wake_up to transpose, so the Parameters it replaced are put back (:func:`after_wake_up`), and post-load
processing of Parameters that are already processed is skipped (:func:`before_process_weights`) -- which is what
a framework that re-runs it after ``load_weights`` needs. Parameters that vLLM's reload re-creates from its
construction-time record carry no mark: they are preprocessed, and processed normally. ``hwsync/patches/vllm_ascend.py``
only wires these functions around the two vllm-ascend methods. FRACTAL_NZ storage is refused: its bytes are not a
strided view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hwsync.common.errors import LayoutError
from hwsync.common.layouts import ExpertLayout, ExpertSharding, copy_expert_shard_

__all__ = [
    "ACL_FORMAT_FRACTAL_NZ",
    "LAYOUT_ATTR",
    "ExpertParamsSnapshot",
    "after_process_weights",
    "after_wake_up",
    "before_process_weights",
    "before_wake_up",
    "expert_layout",
    "is_fractal_nz",
    "moe_layers",
    "processed_weight_loader",
    "reattach_loaders",
    "set_expert_layout",
]

ACL_FORMAT_FRACTAL_NZ = 29  # torch_npu's format id of FRACTAL_NZ
LAYOUT_ATTR = "hwsync_expert_layout"  # on w13/w2 Parameters: the ExpertLayout they hold
_UNWRITABLE_ATTR = "hwsync_experts_unwritable"  # on the MoE layer: why its experts cannot be written
_PARAMS = ("w13_weight", "w2_weight")
_LOADER_MARK = "hwsync_processed_loader"


def expert_layout(layer: Any) -> ExpertLayout:
    """The layout of the experts ``layer`` holds now: the mark on its w13 Parameter, preprocessed when unmarked
    (Parameters vLLM created or re-created for a reload). Refuses a layer whose experts live in per-expert lists."""
    unwritable = getattr(layer, _UNWRITABLE_ATTR, None)
    if unwritable:
        raise LayoutError(unwritable)
    param = layer._parameters.get("w13_weight")
    return ExpertLayout(getattr(param, LAYOUT_ATTR, ExpertLayout.PREPROCESSED))


def set_expert_layout(layer: Any, layout: ExpertLayout | str) -> None:
    """Mark ``layer``'s w13/w2 Parameters as holding ``layout``."""
    for name in _PARAMS:
        param = layer._parameters.get(name)
        if isinstance(param, torch.Tensor):
            setattr(param, LAYOUT_ATTR, ExpertLayout(layout))


def is_fractal_nz(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is NPU storage in FRACTAL_NZ format (only checked on NPU tensors)."""
    if tensor.device.type != "npu":
        return False
    import torch_npu  # only hwsync.common.npu may import it

    return int(torch_npu.get_npu_format(tensor)) == ACL_FORMAT_FRACTAL_NZ


def moe_layers(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    """The modules that own expert weights (``w13_weight`` and ``w2_weight`` plus vLLM's ``weight_loader``)."""
    for name, module in model.named_modules():
        if all(isinstance(module._parameters.get(p), torch.Tensor) for p in _PARAMS) and callable(
            getattr(module, "weight_loader", None)
        ):
            yield name, module


def processed_weight_loader(layer: Any, sharding: ExpertSharding | None = None) -> Callable[..., bool | None]:
    """A loader with vLLM's ``weight_loader`` signature that writes one HF expert tensor into processed storage.

    ``weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False)`` with
    ``shard_id`` in w1 (gate [I, H]) / w3 (up [I, H]) / w2 (down [H, I]) and a *global* ``expert_id``; experts
    of other EP ranks are skipped (False), this rank's TP slice is taken, exactly as vLLM's loader does for the
    preprocessed layout. ``sharding`` defaults to the layer's live one (read at each call).
    """

    def weight_loader(
        param: torch.Tensor,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        if loaded_weight.dim() != 2 or "bias" in weight_name or "scale" in weight_name:
            raise LayoutError(
                f"{weight_name}: hwsync's processed-layout loader takes unquantized per-expert weight matrices "
                f"(got shape {tuple(loaded_weight.shape)}); load quantized / biased experts through vLLM's reload "
                "(model_runner.reload_weights), which restores the checkpoint layout and processes again"
            )
        # Limitation L3 (docs/limitations.md): NZ / quantized / biased processed experts are not written in place
        if is_fractal_nz(param):
            raise LayoutError(
                f"{weight_name}: the experts are stored in FRACTAL_NZ, which cannot be written in place; disable NZ "
                "(vllm-ascend additional_config weight_nz_mode=0, or VLLM_ASCEND_ENABLE_NZ=0 on older releases)"
            )
        live = sharding if sharding is not None else ExpertSharding.from_vllm(layer)
        written = copy_expert_shard_(param.data, loaded_weight, shard_id, int(expert_id), live, ExpertLayout.PROCESSED)
        return written if return_success else None

    setattr(weight_loader, _LOADER_MARK, True)
    return weight_loader


@dataclass
class ExpertParamsSnapshot:
    """The expert Parameters of one layer before an upstream step that may replace them."""

    layer: Any
    params: dict[str, torch.Tensor]
    attrs: dict[str, dict[str, Any]]
    layout: ExpertLayout


def _snapshot(layer: Any) -> ExpertParamsSnapshot:
    params = {n: layer._parameters[n] for n in _PARAMS if isinstance(layer._parameters.get(n), torch.Tensor)}
    return ExpertParamsSnapshot(layer, params, {n: dict(vars(p)) for n, p in params.items()}, expert_layout(layer))


def reattach_loaders(layer: Any, attrs: dict[str, dict[str, Any]], layout: ExpertLayout) -> None:
    """Give the current w13/w2 Parameters the attributes their predecessors had, with a loader for ``layout``.

    Preprocessed gets vLLM's loader back (the very object); processed gets :func:`processed_weight_loader`.
    """
    for name in _PARAMS:
        param: Any = layer._parameters.get(name)  # a vLLM parameter: carries its weight_loader
        if not issubclass(type(param), torch.Tensor):  # (not isinstance: param keeps its vLLM attributes' type)
            continue
        old = attrs.get(name, {})
        for key, value in old.items():
            if key != "weight_loader" and not hasattr(param, key):
                setattr(param, key, value)
        upstream_loader = old.get("weight_loader")
        if upstream_loader is not None and getattr(upstream_loader, _LOADER_MARK, False):
            upstream_loader = None  # ours from an earlier round: fall back to the layer's own loader
        if layout is ExpertLayout.PROCESSED:
            param.weight_loader = processed_weight_loader(layer)
        else:
            param.weight_loader = upstream_loader or layer.weight_loader
    set_expert_layout(layer, layout)


def before_process_weights(layer: Any) -> ExpertParamsSnapshot | None:
    """Call before vllm-ascend's post-load processing; ``None`` means: skip it, the experts are processed already.

    Processing transposes; run on processed experts it would transpose them a second time (garbage experts). They
    are processed only when hwsync marked them so, and then every write since went through
    :func:`processed_weight_loader`, in the processed layout: there is nothing left to do.
    """
    if expert_layout(layer) is ExpertLayout.PROCESSED:
        return None
    return _snapshot(layer)


def after_process_weights(snapshot: ExpertParamsSnapshot) -> None:
    """Call after vllm-ascend's post-load processing: the experts are processed; attach a matching loader.

    When the processing moved the experts into per-expert lists (fused MC2 with dynamic EPLB) there is no
    w13/w2 left to write into: the layer is marked so that a sync refuses it instead of writing nowhere.
    """
    layer = snapshot.layer
    if not all(isinstance(layer._parameters.get(n), torch.Tensor) for n in _PARAMS):
        setattr(
            layer,
            _UNWRITABLE_ATTR,
            f"{type(layer).__name__}: vllm-ascend moved the experts into per-expert lists (fused MC2 with dynamic "
            "EPLB); hwsync cannot write them: disable enable_fused_mc2 or dynamic EPLB for weight sync",
        )
        return
    reattach_loaders(layer, snapshot.attrs, ExpertLayout.PROCESSED)


def before_wake_up(model: torch.nn.Module) -> list[ExpertParamsSnapshot]:
    """Call before ``NPUWorker.wake_up``: remember every MoE layer's expert Parameters."""
    return [_snapshot(layer) for _, layer in moe_layers(model) if not getattr(layer, _UNWRITABLE_ATTR, None)]


def after_wake_up(snapshots: list[ExpertParamsSnapshot]) -> int:
    """Call after ``NPUWorker.wake_up``: put back every expert Parameter it replaced; returns how many.

    Released wake_ups replace processed experts by transposed views (to let vLLM's checkpoint-layout loader write
    them) and, in the square cases, preprocessed experts too (a misfired shape guess). hwsync's loaders write the
    layout a Parameter is marked with, so no transposition is wanted: the predecessors -- the same storage, the
    bytes the allocator just restored, their loaders and marks intact -- are what the engine must hold.
    """
    restored = 0
    for snap in snapshots:
        for name, before in snap.params.items():
            if snap.layer._parameters.get(name) is not before:
                setattr(snap.layer, name, before)
                restored += 1
    return restored
