"""hwsync.common.foreign: one dict of hwsync's state per foreign object, invisible to the owner's own machinery."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from hwsync.common import foreign


def test_state_lives_in_one_attribute_the_owner_never_sees() -> None:
    model = nn.Linear(4, 4)
    foreign.state_of(model)["uuid"] = "abc"
    foreign.state_of(model)["tensor"] = torch.ones(2)  # not registered by nn.Module.__setattr__
    assert foreign.held(model, "uuid") == "abc" and foreign.held(model, "missing", 7) == 7
    assert set(model.state_dict()) == {"weight", "bias"} and len(list(model.buffers())) == 0
    assert [k for k in vars(model) if "hwsync" in k] == [foreign.KEY]


def test_views_and_copies_of_a_tensor_carry_nothing() -> None:
    t = torch.zeros(4)
    foreign.state_of(t)["kept fold buffer"] = True
    assert foreign.held(t, "kept fold buffer") is True
    assert foreign.held(t[:2], "kept fold buffer") is None and foreign.held(t.detach(), "kept fold buffer") is None


def test_forget_leaves_nothing_behind_and_state_dies_with_its_object() -> None:
    class Owner:
        pass

    owner, payload = Owner(), Owner()
    foreign.state_of(owner)["guard"] = payload
    assert foreign.forget(owner, "guard") is payload and vars(owner) == {}
    assert foreign.forget(owner, "guard") is None and foreign.held(owner, "guard") is None
    foreign.state_of(owner)["guard"] = payload
    ref = weakref.ref(payload)
    del owner, payload
    gc.collect()
    assert ref() is None  # no global table kept it alive


def test_an_object_without_a_dict_is_refused_not_silently_skipped() -> None:
    class Slotted:
        __slots__ = ("x",)

    with pytest.raises(TypeError):
        foreign.state_of(Slotted())
    assert foreign.held(Slotted(), "x", "default") == "default"


def test_a_copied_model_is_another_model() -> None:
    """The trainer's per-model identity (plans are cached under it) does not travel with a copy of the model: a
    reference model deep-copied from a synced policy must not reuse the policy's plans."""
    import copy

    from hwsync.trainer.payload import model_uuid

    model = nn.Linear(4, 4)
    first = model_uuid(model)
    assert model_uuid(model) == first
    clone = copy.deepcopy(model)
    assert model_uuid(clone) != first and model_uuid(model) == first
    shallow = copy.copy(model)  # shares the original's state dict object: the original keeps its identity
    assert model_uuid(shallow) != first and model_uuid(model) == first
