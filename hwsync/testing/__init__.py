"""Offline test fixtures: tiny random MoE checkpoints, in-process vLLM engines with per-platform settings, and
engine-own references (what vLLM serves when it loads the same weights itself).

Nothing here downloads anything; heavy imports (torch, transformers, vllm) happen inside the functions.
"""

from __future__ import annotations

from .engine import (
    CPU_LORA_TARGETS,
    close_llm,
    engine_args,
    engine_patches,
    make_llm,
    on_cpu,
    patched_llm,
    portable_kernel_args,
    require_vllm,
    vllm_cpu_env,
    vllm_env,
    vllm_missing_reason,
)
from .reference import EXACT_ATOL, EngineReference, ReferenceMismatch, assert_serves
from .tiny_moe import FAMILIES, FixtureConfigError, make_tiny_moe, tiny_moe_config

__all__ = [
    "CPU_LORA_TARGETS",
    "EXACT_ATOL",
    "EngineReference",
    "FAMILIES",
    "FixtureConfigError",
    "ReferenceMismatch",
    "assert_serves",
    "close_llm",
    "engine_args",
    "engine_patches",
    "make_llm",
    "make_tiny_moe",
    "on_cpu",
    "patched_llm",
    "portable_kernel_args",
    "require_vllm",
    "tiny_moe_config",
    "vllm_cpu_env",
    "vllm_env",
    "vllm_missing_reason",
]
