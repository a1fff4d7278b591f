"""The parameter names a model's ``load_weights`` was written against, on an engine whose layers LoRA has wrapped.

vLLM loads the checkpoint first and wraps layers for LoRA afterwards (``qkv_proj`` becomes a ``*WithLoRA`` module
holding the original layer as ``base_layer``), so every later load sees ``qkv_proj.base_layer.weight`` where the
first saw ``qkv_proj.weight``. Loaders that walk modules with ``AutoWeightsLoader`` reach the wrapper and it forwards
(``BaseLayerWithLoRA.load_weights``, vLLM #39935); loaders that index ``dict(self.named_parameters())`` by checkpoint
names do not: in vLLM 0.32 GPT-OSS and Llama 4 raise ``KeyError: '...qkv_proj.weight'`` on every reload into a
LoRA engine, and GPT-OSS skips ``o_proj`` silently (``if name not in params_dict: continue``). vLLM issue #39934;
PR #48337 (open) would flatten ``base_layer`` out of the module tree.

:func:`checkpoint_names` gives those loaders the names of the first load for the duration of one hwsync dry run or
reload: each module above a LoRA wrapper lists its parameters without ``.base_layer.`` segments (instance attribute,
removed on exit; the module tree, the parameters and their loaders are untouched). Nothing changes on an engine
without wrappers or on a vLLM whose names carry no ``base_layer``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["checkpoint_names"]


def _canonical(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "base_layer")


def _view(module: torch.nn.Module) -> Any:
    """``module.named_parameters`` with ``base_layer`` segments removed (a real name wins over an alias)."""
    original = type(module).named_parameters.__get__(module)

    def named_parameters(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Any]:
        items = list(original(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate))
        real = {n for n, _ in items}
        for name, p in items:
            alias = _canonical(name)
            yield (alias if alias == name or alias not in real else name), p

    named_parameters.hwsync_checkpoint_view = True  # type: ignore[attr-defined]
    return named_parameters


@contextlib.contextmanager
def checkpoint_names(model: torch.nn.Module) -> Iterator[int]:
    """For the ``with`` block, every module above a LoRA wrapper (``base_layer`` child) lists its parameters under
    their checkpoint names; yields how many modules got the view."""
    modules = dict(model.named_modules())
    wrappers = [n for n, m in modules.items() if isinstance(m._modules.get("base_layer"), torch.nn.Module)]
    above = {".".join(n.split(".")[:k]) for n in wrappers for k in range(n.count(".") + 1)} if wrappers else set()
    changed: list[torch.nn.Module] = []
    for name in sorted(above):
        module = modules[name]
        if "named_parameters" not in vars(module):
            module.named_parameters = _view(module)
            changed.append(module)
    try:
        yield len(changed)
    finally:
        for module in changed:
            vars(module).pop("named_parameters", None)
