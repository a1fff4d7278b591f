"""Offline test fixtures: tiny random MoE checkpoints and an in-process vLLM CPU engine.

Nothing here downloads anything; heavy imports (torch, transformers, vllm) happen inside the functions.
"""
from __future__ import annotations

from .engine import make_llm, require_vllm, vllm_cpu_env, vllm_missing_reason
from .logprobs import hf_logprobs, vllm_logprobs
from .tiny_moe import FAMILIES, FixtureConfigError, make_tiny_moe, tiny_moe_config

__all__ = [
    "FAMILIES",
    "FixtureConfigError",
    "hf_logprobs",
    "make_llm",
    "make_tiny_moe",
    "require_vllm",
    "tiny_moe_config",
    "vllm_cpu_env",
    "vllm_logprobs",
    "vllm_missing_reason",
]
