"""``vllm_lora_manager_guards``: a worker hwsync syncs refuses a user's adapter under hwsync's id, and says why an
evicted in-memory adapter cannot come back, through vLLM's own worker LoRA manager.

On vLLM's real ``LRUCacheWorkerLoRAManager`` (an adapter cache standing in for the model's LoRA manager): a worker that
hwsync's receiver attached to refuses both with one ``SyncError``; a manager hwsync did not attach to keeps vLLM's
behaviour (the id collision served silently); once the worker is collected vLLM's classes hold their own methods again
and nothing is left on the manager. The real engine: ``test_a_user_adapter_under_hwsyncs_id_is_refused``
(``tests/test_attacks_reliability.py``), ``test_an_evicted_adapter_says_so_and_a_sync_reinstalls_it``
(``tests/test_attacks_adapters.py``).
"""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hwsync.patches as patches
from hwsync.common.errors import SyncError
from hwsync.testing import require_vllm

PATCH = patches.get("vllm_lora_manager_guards")


class _Adapters:
    """The model's LoRA manager as vLLM's worker manager uses it: an id-keyed cache."""

    def __init__(self, ids: set[int]) -> None:
        self.ids, self.capacity, self.active = set(ids), 4, []

    def list_adapters(self) -> dict[int, Any]:
        return {i: object() for i in self.ids}

    def get_adapter(self, adapter_id: int) -> Any:
        return object() if adapter_id in self.ids else None

    def activate_adapter(self, adapter_id: int) -> bool:
        self.active.append(adapter_id)
        return True

    def __len__(self) -> int:
        return len(self.ids)


def _manager(ids: set[int]) -> Any:
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    manager = LRUCacheWorkerLoRAManager.__new__(LRUCacheWorkerLoRAManager)  # vLLM's class, no model needed
    manager._adapter_manager = _Adapters(ids)
    return manager


class _Worker:
    """Enough of a vLLM worker for hwsync's receiver: a model runner with a LoRA manager and a one-layer model."""

    def __init__(self, manager: Any) -> None:
        model = torch.nn.Linear(2, 2)
        config = SimpleNamespace(model_config=SimpleNamespace(sleep_preserve_parameter_names=None))
        self.model_runner = SimpleNamespace(get_model=lambda: model, vllm_config=config, lora_manager=manager)


def _request(lora_id: int, path: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest("mine", lora_id, path)


def test_probe_applies_on_the_installed_vllm() -> None:
    require_vllm()
    result = PATCH.probe(refresh=True)
    assert result.state == patches.APPLIES, result.reason
    assert PATCH.opt_in and PATCH.name not in {p.name for p in patches.select(None)}  # never plugin-wide


def test_unguarded_vllm_serves_another_path_under_a_loaded_id() -> None:
    """The bug: vLLM keys adapters by id alone, so a user's own path under hwsync's id is served hwsync's adapter."""
    require_vllm()
    from hwsync.engine.vllm.applier import LORA_INT_ID

    assert not PATCH.active
    manager = _manager({LORA_INT_ID})
    assert manager.add_adapter(_request(LORA_INT_ID, "/the/users/own/adapter")) is True
    assert manager._adapter_manager.active == [LORA_INT_ID]


def test_a_worker_hwsync_attached_to_refuses_both_and_nothing_stays_patched() -> None:
    require_vllm()
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    from hwsync.common.target import IN_MEMORY_LORA
    from hwsync.engine.vllm.applier import LORA_INT_ID
    from hwsync.engine.vllm.worker import AdapterGuard, receiver_of
    from hwsync.patches.vllm_lora_manager_guards import guard_of

    add = LRUCacheWorkerLoRAManager.__dict__["add_adapter"]
    load = WorkerLoRAManager.__dict__["_load_adapter"]
    assert not PATCH.active
    manager, other = _manager({LORA_INT_ID}), _manager({LORA_INT_ID})
    worker = _Worker(manager)
    receiver_of(worker)  # what every hwsync call on a worker does first
    assert PATCH.active and isinstance(guard_of(manager), AdapterGuard) and guard_of(other) is None
    assert LRUCacheWorkerLoRAManager.__dict__["add_adapter"] is not add
    assert not {"add_adapter", "_load_adapter"} & set(vars(manager))  # nothing on the instance but the guard

    with pytest.raises(SyncError, match="uses lora_int_id 26739.*another lora_int_id"):
        manager.add_adapter(_request(LORA_INT_ID, "/the/users/own/adapter"))
    ours = _request(LORA_INT_ID, f"{IN_MEMORY_LORA}hwsync")
    assert manager.add_adapter(ours) is True  # hwsync's own request: vLLM's touch
    manager._adapter_manager.ids.clear()  # evicted behind hwsync's back
    with pytest.raises(SyncError, match="synced by hwsync and is no longer in the engine.*hwsync.sync"):
        manager.add_adapter(ours)
    assert other.add_adapter(_request(LORA_INT_ID, "/the/users/own/adapter")) is True  # unguarded: vLLM's own

    del worker, manager
    gc.collect()
    assert not PATCH.active, "the patch outlived the only guarded worker"
    assert LRUCacheWorkerLoRAManager.__dict__["add_adapter"] is add
    assert WorkerLoRAManager.__dict__["_load_adapter"] is load
    assert "_load_adapter" not in LRUCacheWorkerLoRAManager.__dict__  # inherited again, not copied down


def test_guard_is_released_from_a_manager_that_outlives_its_worker() -> None:
    require_vllm()
    from hwsync.engine.vllm.worker import guard_adapters
    from hwsync.patches.vllm_lora_manager_guards import guard_of

    manager = _manager(set())
    worker = _Worker(manager)
    assert guard_adapters(worker) and guard_adapters(worker) and guard_of(manager) is not None
    del worker
    gc.collect()
    assert not PATCH.active and guard_of(manager) is None and vars(manager).keys() == {"_adapter_manager"}


def test_switched_off_leaves_vllm_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    require_vllm()
    from hwsync.engine.vllm.worker import guard_adapters
    from hwsync.patches.vllm_lora_manager_guards import guard_of

    monkeypatch.setenv(patches.DISABLE_ENV, PATCH.name)
    manager = _manager(set())
    assert not guard_adapters(_Worker(manager)) and not PATCH.active and guard_of(manager) is None
