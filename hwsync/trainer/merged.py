"""Merged view W0 + ΔW of a PEFT model, computed into new buffers.

GRPO with LoRA often syncs *merged* weights to the rollout engine (the engine then needs no LoRA support, and
MoE LoRA needs Triton kernels the CPU/NPU builds lack). PEFT's ``merge_adapter()``/``unmerge_adapter()`` rewrites
the trainer's base weights twice per step: lossy in bf16 (W + ΔW - ΔW != W), impossible for 4-bit QLoRA bases, and
racy if anything reads the weights in between. :func:`merged_named_weights` instead yields, lazily and one
parameter at a time, ``W0 + ΔW`` in a fresh buffer (computed in fp32, one rounding to the output dtype) and never
writes to the model. Parameters without LoRA pass through as they are (``detach()``-ed, no copy).

Names are the trainer's runtime names without PEFT's wrappers (``base_model.model.``, ``.base_layer``,
``modules_to_save.<adapter>.``, ``.original_module``, ``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.``,
``_orig_mod.``), e.g. ``model.layers.0.mlp.experts.gate_up_proj``. Buffers are not yielded (the trainer does not
train them). Sharded parameters (FSDP2 / ZeRO-3) are read through :func:`hwsync.common.gather.full`: the caller gathers
them (:func:`hwsync.common.gather.gathered`, :func:`read_sets` says which parameters each merged tensor reads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hwsync.common.errors import AdapterFormatError, UnsupportedSetupError
from hwsync.common.gather import full, global_shape, param_kind, read
from hwsync.common.trainer_names import strip_peft_name

__all__ = [
    "merged_named_weights",
    "delta_weight",
    "plain_weight",
    "logical_shape",
    "is_quantized",
    "read_sets",
    "refuse_non_lora",
]

# Chunk the fp32 temporaries of stacked experts to about this many bytes.
_CHUNK_BYTES = 256 << 20

PeftLayer = Any
"""A PEFT LoRA layer (``peft.tuners.lora.LoraLayer``): its per-adapter attributes (``lora_A[adapter]``, ``scaling``,
...) are set at runtime, which torch's ``Module.__getattr__`` types as ``Tensor | Module``."""


@dataclass(frozen=True)
class _Contribution:
    layer: PeftLayer
    adapter: str
    sign: float  # +1 add, -1 remove a delta that is merged into the stored weight but disabled
    part: str  # "weight" or "bias"


def refuse_non_lora(model: nn.Module) -> None:
    """Raise :class:`AdapterFormatError` (:func:`hwsync.common.lora_formats.not_lora_reason`) when an active adapter of
    ``model`` is not LoRA (IA3, prompt tuning, ...): no strategy can sync it."""
    from hwsync.common.lora_formats import not_lora_reason, peft_type

    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    active = getattr(model, "active_adapters", None)
    active = [active] if isinstance(active, str) else list(active or configs)
    for name in active:
        cfg = configs.get(name)
        if cfg is not None and peft_type(cfg) != "LORA":
            raise AdapterFormatError(not_lora_reason(name, peft_type(cfg)))


def _active_lora_adapters(layer: PeftLayer) -> tuple[list[str], list[str]]:
    """(adapters to add, adapters to subtract), mirroring what the layer's forward uses."""
    merged = [a for a in getattr(layer, "merged_adapters", []) if a in _adapter_keys(layer)]
    if getattr(layer, "disable_adapters", False):
        return [], merged  # forward unmerges and runs the base weight alone
    if merged:
        return [], []  # forward runs the stored (already merged) weight
    return [a for a in layer.active_adapters if a in _adapter_keys(layer)], []


def _adapter_keys(layer: PeftLayer) -> set[str]:
    keys = set(getattr(layer, "lora_A", {}).keys())
    keys |= set(getattr(layer, "lora_embedding_A", {}).keys())
    return keys


def _collect(model: nn.Module) -> tuple[dict[int, list[_Contribution]], set[int], set[int]]:
    """id(param) -> contributions; ids of adapter params; ids of inactive modules_to_save copies / originals."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import ModulesToSaveWrapper

        wrappers: tuple[type[Any], ...] = (ModulesToSaveWrapper,)
    except ImportError:  # pragma: no cover - older peft
        wrappers = ()

    contrib: dict[int, list[_Contribution]] = {}
    adapter_params: set[int] = set()
    hidden: set[int] = set()
    for mod_name, module in model.named_modules():
        if wrappers and isinstance(module, wrappers):
            act = module.active_adapters
            use = None if module.disable_adapters or not act or act[0] not in module.modules_to_save else act[0]
            for name, copy in module.modules_to_save.items():
                if name != use:
                    hidden.update(id(p) for p in copy.parameters())
            if use is not None:
                hidden.update(id(p) for p in module.original_module.parameters())
            continue
        if not isinstance(module, BaseTunerLayer):
            continue
        for attr in module.adapter_layer_names:
            holder = getattr(module, attr, None)
            if isinstance(holder, nn.Module):
                adapter_params.update(id(p) for p in holder.parameters())
        if not isinstance(module, LoraLayer):
            raise AdapterFormatError(
                f"{mod_name} is a {type(module).__name__} ({type(module).__module__}), not a LoRA layer: the merged "
                "view covers LoRA only. Merge this adapter on a copy with PEFT and sync full weights"
            )
        add, sub = _active_lora_adapters(module)
        if not add and not sub:
            continue
        target = module.get_param() if isinstance(module, ParamWrapper) else module.get_base_layer().weight
        for adapter, sign in [(a, 1.0) for a in add] + [(a, -1.0) for a in sub]:
            contrib.setdefault(id(target), []).append(_Contribution(module, adapter, sign, "weight"))
            if getattr(module, "lora_bias", {}).get(adapter, False):
                bias = getattr(module.get_base_layer(), "bias", None)
                if bias is None:
                    raise AdapterFormatError(f"{mod_name}: lora_bias=True but the base layer has no bias")
                contrib.setdefault(id(bias), []).append(_Contribution(module, adapter, sign, "bias"))
    return contrib, adapter_params, hidden


def delta_weight(layer: PeftLayer, adapter: str = "default", *, experts: slice | None = None) -> Tensor:
    """ΔW of one PEFT LoRA layer for ``adapter`` in fp32, in the layout of the parameter it adapts.

    Same formula as PEFT's ``get_delta_weight`` (``B @ A * scaling``; for a 3-D ``ParamWrapper``
    ``einsum("o r e, e r i -> e o i")``), but always in fp32 and never cast down. ``experts`` limits a stacked
    expert delta to a slice of experts (to bound memory). DoRA and other LoRA variants have no additive ΔW: use
    :func:`merged_named_weights`, which applies them through PEFT's ``merge_safe``.
    """
    from peft.tuners.lora.layer import Embedding, ParamWrapper

    if adapter in getattr(layer, "lora_variant", {}):
        raise AdapterFormatError(
            f"adapter {adapter!r} on {type(layer).__name__} is a LoRA variant "
            f"({type(layer.lora_variant[adapter]).__name__}) with no additive ΔW"
        )
    s = float(layer.scaling[adapter])
    # issubclass, not isinstance: a PEFT layer stays PeftLayer (narrowing would retype its runtime attributes)
    if issubclass(type(layer), ParamWrapper) and layer.num_experts > 1:
        e = layer.num_experts
        a = full(layer.lora_A[adapter].weight)
        b = full(layer.lora_B[adapter].weight)
        a = a.reshape(e, -1, a.shape[-1])
        b = b.reshape(b.shape[0], -1, e)
        if experts is not None:
            a, b = a[experts], b[..., experts]
        spec = "o r e, e r i -> e o i" if layer._did_swap_in_out_features else "o r e, e r i -> e i o"
        return torch.einsum(spec, b.float(), a.float()) * s
    if issubclass(type(layer), Embedding) and adapter in layer.lora_embedding_A:
        a, b = full(layer.lora_embedding_A[adapter]), full(layer.lora_embedding_B[adapter])
        return (b.float() @ a.float()).T * s
    holder = getattr(layer, "lora_A", None)
    lin_a = holder[adapter] if holder is not None and adapter in holder else None
    if isinstance(lin_a, nn.Linear):  # lora.Linear, quantized Linear variants, 2-D ParamWrapper
        w = full(layer.lora_B[adapter].weight).float() @ full(lin_a.weight).float()
        return (w.T if getattr(layer, "fan_in_fan_out", False) else w) * s
    # Conv and other LoRA layer types: PEFT's own math, lifted to fp32.
    _refuse_sharded(layer, "its LoRA type")
    return layer.get_delta_weight(adapter).float()


def _base_weight(layer: PeftLayer, param: Tensor) -> Tensor:
    """The base weight as a floating tensor (dequantized for bnb / HQQ / torchao QLoRA bases)."""
    if param.is_floating_point() and type(param).__name__ not in ("Params4bit", "Int8Params"):
        return full(param).detach()
    _refuse_repacked(f"of {type(layer).__name__} layer", param)
    from peft.utils.integrations import dequantize_module_weight

    return dequantize_module_weight(layer.get_base_layer()).detach()


def is_quantized(param: Tensor) -> bool:
    """A bitsandbytes 4-/8-bit base parameter (QLoRA): packed storage, dequantized for the engine."""
    return type(param).__name__ in ("Params4bit", "Int8Params")


def repacked_for_cpu(param: Tensor) -> bool:
    """Whether bitsandbytes repacked this 4-bit weight in place for its AVX512-BF16 CPU kernel: bitsandbytes 0.50's
    ``Linear4bit.forward`` does so at the first eval-mode forward without grad on such a CPU, and from then on runs
    the layer in bf16 (``gemv_4bit``: "cpu fused op only support bf16 for now") and ``dequantize_4bit`` no longer
    reads the weight right (only its ``_save_to_state_dict`` unpacks it)."""
    return bool(getattr(getattr(param, "quant_state", None), "packing_format_for_cpu", False))


def four_bit_matmul_dtype(model: nn.Module) -> str | None:
    """``"bfloat16"`` where the trainer's 4-bit layers run in bf16 whatever their compute dtype says
    (:func:`repacked_for_cpu`): such a trainer differs from an fp32 engine by bf16 rounding (measured: mean
    |Δ logprob| 0.12 on the tiny MoE), so :mod:`hwsync.verify` judges it by the bf16 gate. ``None`` elsewhere."""
    return "bfloat16" if any(repacked_for_cpu(p) for p in model.parameters()) else None


def logical_shape(param: Tensor) -> tuple[int, ...]:
    """The shape the weight has for the engine: the dequantized shape of a packed 4-bit parameter."""
    state = getattr(param, "quant_state", None)
    if is_quantized(param) and state is not None and getattr(state, "shape", None) is not None:
        return tuple(int(d) for d in state.shape)
    return global_shape(param)  # a sharded (FSDP2 / ZeRO-3) parameter: its gathered shape


def plain_weight(model: nn.Module, name: str, param: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A parameter no adapter touches: as is, or dequantized when a QLoRA base quantized it (a 4-bit layer without
    LoRA is still a weight the engine needs in floating point)."""
    if not is_quantized(param):
        return read(param)
    _refuse_repacked(name, param)
    from peft.utils.integrations import dequantize_module_weight

    module = model.get_submodule(name.rpartition(".")[0])
    with torch.no_grad():
        weight = dequantize_module_weight(module).detach()
    return weight.to(dtype) if dtype is not None else weight


def _refuse_repacked(name: str, param: Tensor) -> None:
    if repacked_for_cpu(param):
        raise UnsupportedSetupError(
            f"bitsandbytes repacked the 4-bit weight {name} for its AVX512-BF16 CPU kernel (an eval-mode forward "
            "without grad does this on such a CPU) and can no longer dequantize it, so its value cannot be sent. "
            "Keep the trainer's bitsandbytes layers in train mode for forwards outside training (hwsync.verify does), "
            'or sync with strategy="adapter" once the engine holds the base'
        )


def _refuse_sharded(layer: PeftLayer, what: str) -> None:
    if any(param_kind(p) != "plain" for p in layer.parameters()):
        raise UnsupportedSetupError(
            f"{type(layer).__name__}: the merged view of {what} runs PEFT's own code on the layer's parameters, "
            "which are sharded (FSDP2 / ZeRO-3) here; sync plain LoRA, or merge on an unsharded copy"
        )


def read_sets(model: nn.Module) -> dict[str, list[str]]:
    """Merged-view name -> the names (in ``model.named_parameters()``) of every parameter computing it reads: the
    base parameter and the LoRA factors (and LoRA biases) of the adapters merged into it."""
    names = {id(p): n for n, p in model.named_parameters()}
    contrib, adapter_params, hidden = _collect(model)
    out: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        pid = id(param)
        if pid in adapter_params or pid in hidden:
            continue
        reads = [name]
        for c in contrib.get(pid, []):
            holders = [
                getattr(c.layer, attr, {})
                for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
            ]
            for h in holders:
                if c.adapter not in h:
                    continue
                v = h[c.adapter]
                for p in v.parameters() if isinstance(v, nn.Module) else [v]:
                    if id(p) in names:
                        reads.append(names[id(p)])
        out.setdefault(strip_peft_name(name), list(dict.fromkeys(reads)))
    return out


def _lora_dtype(layer: PeftLayer, adapter: str) -> torch.dtype:
    holder = layer.lora_B[adapter] if adapter in getattr(layer, "lora_B", {}) else layer.lora_embedding_B[adapter]
    dtype: torch.dtype = holder.weight.dtype if issubclass(type(holder), nn.Module) else holder.dtype
    return dtype


def _merge(param: Tensor, contribs: list[_Contribution], dtype: torch.dtype | None) -> Tensor:
    from peft.tuners.lora.layer import ParamWrapper

    first = contribs[0]
    part = first.part
    if part == "bias":
        out = full(param).detach().float()
        for c in contribs:
            out = out + c.sign * full(c.layer.lora_B[c.adapter].bias).float() * float(c.layer.scaling[c.adapter])
        return out.to(dtype or param.dtype)

    base = _base_weight(first.layer, param)
    out_dtype = dtype or (base.dtype if param.is_floating_point() else _lora_dtype(first.layer, first.adapter))
    variants = [c for c in contribs if c.adapter in getattr(c.layer, "lora_variant", {})]
    if variants:
        return _merge_variants(base, contribs, out_dtype)

    layer = first.layer
    stacked = isinstance(layer, ParamWrapper) and layer.num_experts > 1 and base.dim() == 3
    out = torch.empty(base.shape, dtype=out_dtype, device=base.device)
    if not stacked:
        merged = base.float() + sum(c.sign * delta_weight(c.layer, c.adapter) for c in contribs)
        out.copy_(merged)
        return out
    per_expert = max(1, base[0].numel() * 4)
    step = max(1, _CHUNK_BYTES // per_expert)
    for lo in range(0, base.shape[0], step):
        sl = slice(lo, min(lo + step, base.shape[0]))
        merged = base[sl].float() + sum(c.sign * delta_weight(c.layer, c.adapter, experts=sl) for c in contribs)
        out[sl].copy_(merged)
    return out


def _merge_variants(base: Tensor, contribs: list[_Contribution], out_dtype: torch.dtype) -> Tensor:
    """DoRA & co: PEFT's own ``merge_safe`` on a copy (it returns a new tensor and leaves the layer's weight alone)."""
    w = base.clone()
    for c in contribs:
        _refuse_sharded(c.layer, "LoRA variants (DoRA & co)")
        if c.sign < 0:
            raise AdapterFormatError(
                f"{type(c.layer).__name__}: adapter {c.adapter!r} is a merged-then-disabled LoRA variant; "
                "unmerge it (model.unmerge_adapter()) before taking the merged view"
            )
        variant = c.layer.lora_variant.get(c.adapter)
        cache_before = set(getattr(c.layer, "_caches", {}))
        if variant is None:
            w = w + delta_weight(c.layer, c.adapter).to(w.dtype)
        else:
            w = variant.merge_safe(c.layer, c.adapter, w)
        caches = getattr(c.layer, "_caches", None)
        if isinstance(caches, dict):  # merge_safe caches DoRA norms for a later unmerge that never comes
            for key in set(caches) - cache_before:
                caches.pop(key, None)
    return w.to(out_dtype)


def merged_named_weights(
    model: nn.Module,
    *,
    include: Callable[[str], bool] | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(trainer_name, tensor)`` with LoRA deltas applied into new buffers; the model is never written.

    ``include(name)`` filters on the stripped name before any work is done. ``dtype`` casts merged tensors (default:
    the base parameter's dtype, or the LoRA dtype for quantized bases). Follows PEFT's forward semantics per layer:
    active adapters are summed, already-merged adapters are not added twice, disabled adapters are left out.
    """
    refuse_non_lora(model)
    contrib, adapter_params, hidden = _collect(model)
    # no_grad is entered per tensor, never across a ``yield``: a generator suspended inside ``no_grad`` would leave
    # autograd disabled in the trainer for as long as the consumer holds it.
    for name, param in model.named_parameters():
        pid = id(param)
        if pid in adapter_params or pid in hidden:
            continue
        clean = strip_peft_name(name)
        if include is not None and not include(clean):
            continue
        parts = contrib.get(pid)
        if not parts:
            yield clean, plain_weight(model, name, param, dtype)
            continue
        with torch.no_grad():
            merged = _merge(param, parts, dtype)
        yield clean, merged
