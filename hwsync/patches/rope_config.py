"""RoPE config shim: ``convert_rope_params_to_dict(ignore_keys_at_rope_validation=<list>)`` -> set.

transformers 5.0-5.x releases typed ``ignore_keys_at_rope_validation`` as a set and merged it with ``|``;
vLLM 0.18's Qwen3.5 configs (and vllm-ascend stacks built on them) pass a list, so building the config raises
``TypeError: unsupported operand type(s) for |``. vLLM >= 0.19 passes a set literal (vLLM PR 37338) and later
transformers releases accept any iterable. Older transformers (4.x) have no such method: nothing to patch.
"""

from __future__ import annotations

import functools
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["RopeConfigPatch"]

_KEY = "ignore_keys_at_rope_validation"


def _tiny_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )


class RopeConfigPatch(Patch):
    name = "rope_config"
    targets = ("transformers.configuration_utils:PretrainedConfig.convert_rope_params_to_dict",)
    upstream = "https://github.com/vllm-project/vllm/pull/37338"
    seen_in = ("transformers 5.0-5.x with vLLM 0.18 / vllm-ascend 0.18 Qwen3.5 configs",)
    remove_when = "the supported stack has vLLM >= 0.19 (set literal) or a transformers that accepts any iterable"

    def check(self) -> ProbeResult:
        convert = self.original()
        try:
            convert(_tiny_config(), **{_KEY: {"mrope_section"}})
        except Exception as e:
            return ProbeResult(NOT_NEEDED, f"inconclusive: even a set fails ({type(e).__name__}: {e}); left alone")
        try:
            convert(_tiny_config(), **{_KEY: ["mrope_section"]})
        except TypeError as e:
            return ProbeResult(APPLIES, f"a list {_KEY} raises TypeError ({e})")
        import transformers

        return ProbeResult(NOT_NEEDED, f"transformers {transformers.__version__} accepts a list {_KEY}")

    def replacement(self, original: Any, target: str) -> Any:
        if not callable(original):
            raise TypeError(f"{target} is {type(original).__name__}, expected a function")

        @functools.wraps(original)
        def convert_rope_params_to_dict(config: Any, *args: Any, **kwargs: Any) -> Any:
            keys = kwargs.get(_KEY)
            if isinstance(keys, (list, tuple, frozenset)):
                kwargs[_KEY] = set(keys)
            elif args and isinstance(args[0], (list, tuple, frozenset)):  # the 5.0-era positional form
                args = (set(args[0]), *args[1:])
            return original(config, *args, **kwargs)

        return convert_rope_params_to_dict


register(RopeConfigPatch())
