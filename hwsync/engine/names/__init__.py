"""Receiver-side name resolution: which live vLLM parameter (and which rows of it) each trainer tensor writes.

Why: a trainer names weights the transformers way (``q_proj``/``k_proj``/``v_proj`` apart, experts per expert or
fused ``experts.gate_up_proj``, PEFT wrappers such as ``base_model.model.`` and ``.base_layer``), while vLLM stores
them packed and sharded (``qkv_proj``, ``gate_up_proj``, ``in_proj_qkvz``, ``experts.routed_experts.w13_weight``,
tensor-parallel slices). Instead of a per-model name table (which breaks on the next MoE family), resolution reads
what the receiver itself declares (the verl #5599 idea, done generally):

* its live parameters, in the checkpoint-format shapes vLLM recorded before post-load repacking;
* each module's ``hf_to_vllm_mapper`` (vLLM's own renames and stacked shards), applied at that module's scope;
* ``packed_modules_mapping`` (packed owner -> constituents) for vLLM versions whose stacking is not in a mapper;
* every fused-MoE layer's expert mapping (``get_expert_mapping``), its TP/EP sharding and declared layout;
* transformers' checkpoint conversion renames for the model type, reversed (transformers-5 runtime names ->
  checkpoint names, e.g. Mixtral's ``.mlp.`` -> ``.block_sparse_moe.``).

The whole manifest (name -> shape, dtype) is resolved once into a :class:`NameMap`; every problem (unknown name,
ambiguity, shape or dtype that does not fit) is reported together in one :class:`~hwsync.common.errors.ResolutionError`
before any tensor is written. The name map is reused every step: :meth:`NameMap.apply` writes in place (packed rows, TP
slices, experts through :mod:`hwsync.common.layouts`), :meth:`NameMap.vllm_checkpoint_names` translates names for vLLM's
own ``load_weights`` / ``reload_weights`` path (needed where vLLM repacks weights after loading, e.g. its CPU build).
"""

from __future__ import annotations

from hwsync.common.trainer_names import normalize_trainer_name, strip_peft_name
from hwsync.engine.names.namespace import (
    ExpertGroup,
    Namespace,
    ParamSpec,
    Shard,
    namespace_from_vllm_model,
)
from hwsync.engine.names.plan import NameMap, Target
from hwsync.engine.names.resolve import NameMapCache, manifest_of, manifest_signature, resolve

__all__ = [
    "ExpertGroup",
    "Namespace",
    "ParamSpec",
    "NameMap",
    "NameMapCache",
    "Shard",
    "Target",
    "manifest_of",
    "manifest_signature",
    "namespace_from_vllm_model",
    "normalize_trainer_name",
    "resolve",
    "strip_peft_name",
]
