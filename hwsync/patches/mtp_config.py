"""MTP config compatibility: count multi-token-prediction layers wherever the config keeps them.

Checkpoints name the MTP depth differently: DeepSeek / GLM / Qwen3-Next use a top-level
``num_nextn_predict_layers``; Qwen3.5 uses ``mtp_num_hidden_layers``, and its multimodal configs nest it under
``text_config``. Code that reads only the top-level ``num_nextn_predict_layers`` sees 0 (or its default) for
Qwen3.5. In vLLM 0.32, ``SpeculativeConfig.use_multi_module_mtp`` does exactly that, so a Qwen3.5 draft with
``mtp_num_hidden_layers >= 2`` is driven by the single-module MTP speculator (the chain of MTP modules is not
used and the prefill look-ahead is 1 instead of ``num_speculative_tokens``). The patch makes that check read
:func:`mtp_layers`; hwsync itself uses :func:`mtp_layers` / :func:`mtp_disable_overrides` when it decides
whether an engine carries MTP weights that a trainer sync does not cover.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["MTP_KEYS", "MtpConfigPatch", "mtp_disable_overrides", "mtp_layers"]

# Field names that carry the number of MTP layers, across model families.
MTP_KEYS: tuple[str, ...] = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def _text_config(config: Any) -> Any:
    nested = _get(config, "text_config")
    if nested is not None:
        return nested
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            text = get_text_config()
        except Exception:  # some configs raise when they have no decoder
            return None
        return None if text is config else text
    return None


def _places(config: Any) -> list[tuple[tuple[str, ...], Any]]:
    hf = _get(config, "hf_config")  # a vLLM ModelConfig carries the HF config here
    root = hf if hf is not None and not isinstance(config, Mapping) else config
    places: list[tuple[tuple[str, ...], Any]] = [((), root)]
    text = _text_config(root)
    if text is not None:
        places.append((("text_config",), text))
    return places


def mtp_layers(config: Any) -> int:
    """Number of MTP layers a checkpoint config declares (0 = none).

    Reads ``num_nextn_predict_layers`` and ``mtp_num_hidden_layers`` on the config and on its nested
    ``text_config``; accepts a transformers config, a ``config.json`` dict or a vLLM ``ModelConfig``.
    """
    found = 0
    for _, obj in _places(config):
        for key in MTP_KEYS:
            value = _get(obj, key)
            if isinstance(value, int) and not isinstance(value, bool) and value > found:
                found = value
    return found


def mtp_disable_overrides(config: Any) -> dict[str, Any]:
    """vLLM ``hf_overrides`` that set every non-zero MTP field of ``config`` to 0 (nested where it is nested).

    Example for Qwen3.5-MoE: ``{"text_config": {"mtp_num_hidden_layers": 0}}``; empty when there is no MTP.
    """
    overrides: dict[str, Any] = {}
    for path, obj in _places(config):
        for key in MTP_KEYS:
            value = _get(obj, key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                node = overrides
                for part in path:
                    node = node.setdefault(part, {})
                node[key] = 0
    return overrides


class MtpConfigPatch(Patch):
    name = "mtp_config"
    targets = ("vllm.config.speculative:SpeculativeConfig.use_multi_module_mtp",)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/config/speculative.py"
    seen_in = ("vllm 0.32.0",)
    remove_when = "vLLM's use_multi_module_mtp reads mtp_num_hidden_layers / text_config (or n_predict)"

    def check(self) -> ProbeResult:
        from types import SimpleNamespace

        from transformers import PretrainedConfig

        hf_config = PretrainedConfig()
        hf_config.text_config = PretrainedConfig()
        hf_config.text_config.mtp_num_hidden_layers = 2  # a Qwen3.5-style draft config with two MTP modules
        spec = SimpleNamespace(
            method="mtp", num_speculative_tokens=2, draft_model_config=SimpleNamespace(hf_config=hf_config)
        )
        if self.original()(spec):
            return ProbeResult(NOT_NEEDED, "use_multi_module_mtp already sees a nested mtp_num_hidden_layers=2")
        return ProbeResult(
            APPLIES,
            "use_multi_module_mtp returns False for text_config.mtp_num_hidden_layers=2 "
            "(it reads only the top-level num_nextn_predict_layers)",
        )

    def replacement(self, original: Any, target: str) -> Any:
        @functools.wraps(original)
        def use_multi_module_mtp(spec_config: Any) -> bool:
            if original(spec_config):
                return True
            if spec_config.method != "mtp" or spec_config.draft_model_config is None:
                return False
            layers = mtp_layers(spec_config.draft_model_config.hf_config)
            return min(layers, spec_config.num_speculative_tokens) > 1

        return use_multi_module_mtp


register(MtpConfigPatch())
