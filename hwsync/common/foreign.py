"""State hwsync keeps about objects it does not own -- vLLM's workers, LoRA managers and adapters, a ``vllm.LLM``,
ms-swift's engine, the trainer's ``nn.Module``, torch tensors, the functions a wrapper replaces: one rule, one home.

The rule: such an object carries at most one attribute of hwsync's, :data:`KEY`, a dict of everything hwsync keeps
about it (:func:`state_of`), written to the object's ``__dict__`` directly, so

* no ``__setattr__`` of the owner runs (``nn.Module`` would register a tensor, vLLM's classes may validate);
* the state lives and dies with the object: no global table keeps a worker, an adapter or a model alive, and no
  ``id()`` is reused for a new object;
* one name is all hwsync adds to another library's object, so it cannot collide with that library's attributes,
  and a reader of a live object finds hwsync's state in one place (``vars(obj)["__hwsync__"]``).

Not under the rule: hwsync's own objects -- its classes keep their state in their own attributes, its subclasses of
other libraries' classes (the ms-swift and TRL trainers) prefix theirs with ``_hwsync_`` so the parent's keep their
meaning, and the wrappers it installs carry their marks (``__hwsync_patch__``, ``_hwsync_guarded``). One exception,
because the mark must travel as the owner's own attributes do: the expert layout on vllm-ascend's w13/w2 Parameters
(:data:`hwsync.common.npu.ascend_layouts.LAYOUT_ATTR`), copied with their other attributes when a wake re-creates
them. ``tests/test_layering.py`` checks that no other module sets an ``_hwsync_`` attribute on an object not its own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEY", "forget", "held", "state_of", "unshare"]

KEY = "__hwsync__"
"""The one attribute hwsync adds to an object it does not own."""


def state_of(obj: Any) -> dict[str, Any]:
    """hwsync's state about ``obj`` (made empty at the first call). An object without a ``__dict__`` (``__slots__``)
    cannot carry it: :class:`TypeError`, as ``vars`` raises."""
    attrs = vars(obj)
    state = attrs.get(KEY)
    if state is None:
        state = attrs[KEY] = {}
    return state


def unshare(obj: Any) -> dict[str, Any]:
    """``obj``'s state as a dict of its own: a shallow copy of an object (``copy.copy``) shares its original's, and a
    write meant for the copy would reach the original."""
    attrs = vars(obj)
    state = attrs[KEY] = dict(attrs.get(KEY) or {})
    return state


def held(obj: Any, name: str, default: Any = None) -> Any:
    """``state_of(obj)[name]`` without making the state: ``default`` where ``obj`` carries none (or cannot)."""
    state = getattr(obj, "__dict__", {}).get(KEY)
    return default if state is None else state.get(name, default)


def forget(obj: Any, name: str) -> Any:
    """Remove ``name`` from ``obj``'s state (and the state itself once empty: a released object carries nothing of
    hwsync's); its value, or ``None`` where there was none."""
    attrs = getattr(obj, "__dict__", {})
    state = attrs.get(KEY)
    if state is None:
        return None
    value = state.pop(name, None)
    if not state:
        del attrs[KEY]
    return value
