"""``vllm_sleep_watch``: hwsync's sleep watch sees a worker's sleep / wake / discard through vLLM's own dispatch.

Why a patch: vLLM refuses a worker extension that defines ``sleep`` (checked here against vLLM's ``init_worker``).
What it does, on vLLM's real ``WorkerWrapperBase`` and ``run_method`` (the executors' RPC dispatch) around a small
worker: a watched worker's calls reach its :class:`~hwsync.engine.vllm.sleep.SleepWatch`, an unwatched one's are vLLM's
own, and once no watched worker is left vLLM's class holds its own ``__getattr__`` again. The real engine's entry points
(``LLM.sleep``, ``collective_rpc``, the executor's discard) are in ``tests/test_sleep_refill.py``.
"""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hwsync.patches as patches
from hwsync.testing import require_vllm

PATCH = patches.get("vllm_sleep_watch")


class HwsyncSleepExtension:
    """A worker extension that would observe ``sleep`` by overriding it (what vLLM does not allow)."""

    def sleep(self, level: int = 1) -> None:
        raise AssertionError("never reached")


class _Worker:
    """Enough of a vLLM worker for the watch: the three methods and a model runner with a one-layer model."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        model = torch.nn.Linear(2, 2)
        config = SimpleNamespace(model_config=SimpleNamespace(sleep_preserve_parameter_names=None))
        self.model_runner = SimpleNamespace(get_model=lambda: model, vllm_config=config)

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def discard(self, tags: tuple[str, ...]) -> None:
        self.calls.append(("discard", tags))


def _wrapped(worker: Any) -> Any:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.worker = worker  # what init_worker does
    return wrapper


def _rpc(wrapper: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.serial_utils import run_method

    return run_method(wrapper, method, args, kwargs)  # the uniproc executor's collective_rpc, per worker


def test_probe_applies_on_the_installed_vllm() -> None:
    require_vllm()
    result = PATCH.probe(refresh=True)
    assert result.state == patches.APPLIES, result.reason
    assert PATCH.opt_in and "vllm_sleep_watch" not in {p.name for p in patches.select(None)}  # never plugin-wide


def test_vllm_refuses_a_worker_extension_that_overrides_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension point hwsync already uses cannot carry the watch: vLLM asserts before building the worker."""
    require_vllm()
    import vllm.plugins
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    monkeypatch.setattr(vllm.plugins, "load_general_plugins", lambda: None)  # nothing process-wide from here on
    monkeypatch.setattr(current_platform, "register_triton_kernel_overrides", lambda: None)
    bases = CPUWorker.__bases__
    parallel = SimpleNamespace(
        worker_cls="vllm.v1.worker.cpu_worker.CPUWorker", worker_extension_cls=f"{__name__}.HwsyncSleepExtension"
    )
    config = SimpleNamespace(parallel_config=parallel, enable_trace_function_call_for_thread=lambda: None)
    with pytest.raises(AssertionError, match="already has an attribute sleep"):
        WorkerWrapperBase(rpc_rank=0).init_worker([{"vllm_config": config}])
    assert CPUWorker.__bases__ == bases


def test_watched_calls_reach_the_watch_and_nothing_of_vllm_stays_patched() -> None:
    require_vllm()
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from hwsync.engine.vllm.sleep import check_awake, watch

    original = WorkerWrapperBase.__dict__["__getattr__"]
    assert not PATCH.active
    seen: list[str] = []
    worker, other = _Worker(), _Worker()
    w = watch(worker, lambda d: seen.append("discard: " + d.reason), lambda d: seen.append("wake"))
    assert w.observed and PATCH.active and watch(worker, print, print) is w
    assert WorkerWrapperBase.__dict__["__getattr__"] is not original
    assert not {"sleep", "wake_up", "discard"} & set(vars(worker))  # nothing on the instance but the watch

    wrapper, plain = _wrapped(worker), _wrapped(other)
    _rpc(wrapper, "sleep", level=2)
    assert worker.calls == [("sleep", 2)] and w.asleep == "vLLM sleep level 2" and w.discarded is not None
    assert seen == ["discard: vLLM's level-2 sleep discarded the engine's weights"]
    with pytest.raises(Exception, match="asleep"):
        check_awake(worker, "hwsync receive")
    _rpc(wrapper, "wake_up", tags=None)
    assert w.asleep is None and w.discarded.woke and seen[-1] == "wake"
    _rpc(wrapper, "discard", ("weights",))
    assert worker.calls[-1] == ("discard", ("weights",)) and w.asleep == "vLLM discarded the weights tag"
    assert len(seen) == 3

    assert plain.sleep == other.sleep  # an unwatched worker: vLLM's own lookup, untouched
    _rpc(plain, "sleep", level=2)
    assert other.calls == [("sleep", 2)] and len(seen) == 3

    w2 = watch(other, print, print)  # a second watched worker: the patch stays until both are gone
    del w, worker, wrapper
    gc.collect()
    assert PATCH.active
    del w2, other, plain
    gc.collect()
    assert not PATCH.active and WorkerWrapperBase.__dict__["__getattr__"] is original


def test_switched_off_the_watch_says_sleeps_go_unseen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    require_vllm()
    from hwsync.engine.vllm.sleep import watch

    monkeypatch.setenv(patches.DISABLE_ENV, "vllm_sleep_watch")
    worker = _Worker()
    with caplog.at_level(logging.WARNING, logger="hwsync.vllm"):
        w = watch(worker, print, print)
    assert not w.observed and not PATCH.active
    assert "not observed" in caplog.text and "HWSYNC_DISABLE_PATCHES" in caplog.text
    _rpc(_wrapped(worker), "sleep", level=2)
    assert w.sleeps == 0 and worker.calls == [("sleep", 2)]
