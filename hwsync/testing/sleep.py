"""A stand-in for vLLM's level-2 sleep on an engine that has none (vLLM's CPU build: ``CPUWorker.sleep`` only logs).

:func:`stand_in_sleep` makes ``llm.sleep(level=2)`` / ``llm.wake_up()`` -- vLLM's own dispatch, down to the worker --
do to the engine what the CUDA build's sleep does to its weights pool, so hwsync's handling of it runs for real:

* sleep (level 2, or ``discard(("weights",))``): vLLM's ``Worker.sleep`` part first -- the parameters named in
  ``sleep_preserve_parameter_names`` and every buffer saved to host -- then CuMemAllocator's part: every tensor the
  model's modules hold (parameters, buffers, LoRA slots, tensors made by post-load processing) overwritten in place
  with garbage (NaN for floating tensors, zeros otherwise);
* wake: with ``remap=True`` every parameter first gets new storage (new address, NaN): a backend that does not map
  the same virtual addresses, so an in-place write through an address learnt before the sleep would land where no
  kernel reads; then vLLM's part: the saved parameters and buffers copied back.

Like vLLM's GPU worker, the first sleep gives the worker a sleep-mode backend (``_sleep_mode_backend``, whose
``state()`` is ``SUSPENDED`` until the weights wake): how hwsync tells a worker that slept before it attached. Level 1
changes nothing (vLLM copies the weights back exactly). Not simulated: vLLM's punica metadata (rewritten by
vLLM at every step), the KV cache (vLLM resets the prefix cache on sleep).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch

from hwsync.patches.vllm_sleep_watch import observer_of

__all__ = ["StandInSleep", "stand_in_sleep", "worker_of"]


def worker_of(llm: Any) -> Any:
    """The in-process worker of ``llm`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def _garbage(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else 0)


class StandInSleep:
    """Installed on one worker by :func:`stand_in_sleep`; counts what it did (``discards``, ``remapped``)."""

    def __init__(self, worker: Any, remap: bool) -> None:
        self.worker = worker
        self.remap = remap
        self.discards = 0
        self.remapped = 0
        self._saved: dict[str, torch.Tensor] = {}
        self._asleep = False

    def _model(self) -> torch.nn.Module:
        return self.worker.model_runner.get_model()

    def state(self) -> str:
        """vLLM's sleep-mode backend state (``SleepModeBackend.state``): the stand-in is the worker's backend."""
        return "SUSPENDED" if self._asleep else "RUNNING"

    @torch.no_grad()
    def discard(self) -> None:
        from hwsync.engine.vllm.sleep import device_tensors

        model = self._model()
        patterns = list(self.worker.model_runner.vllm_config.model_config.sleep_preserve_parameter_names or [])
        self._saved = {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)
        }
        self._saved.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
        for _kind, _name, t in device_tensors(model):
            _garbage(t.data if isinstance(t, torch.nn.Parameter) else t)
        self.discards += 1
        self._asleep = True

    @torch.no_grad()
    def restore(self) -> None:
        if not self._asleep:
            return
        model = self._model()
        if self.remap:
            for p in model.parameters():
                if p.numel():
                    p.data = (
                        torch.full_like(p.data, float("nan")) if p.is_floating_point() else torch.zeros_like(p.data)
                    )
                    self.remapped += 1
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for name, value in self._saved.items():
            target = buffers[name[7:]] if name.startswith("buffer:") else params[name]
            target.copy_(value)
        self._saved.clear()
        self._asleep = False


def stand_in_sleep(llm: Any, *, remap: bool = False) -> StandInSleep:
    """Make ``llm``'s worker sleep as the CUDA build does (see the module docstring); returns the stand-in. It takes
    the place of vLLM's own worker methods (instance attributes, which vLLM's dispatch finds first), so it goes on
    before hwsync first touches the engine; hwsync's watch then runs around it, as around vLLM's methods on a GPU."""
    worker = worker_of(llm)
    if observer_of(worker) is not None:
        from hwsync.common.errors import FixtureConfigError

        raise FixtureConfigError(
            "stand_in_sleep(llm) must be installed before hwsync first touches the engine "
            "(hwsync's sleep watch observes the worker's methods from its first call)"
        )
    stand_in = StandInSleep(worker, remap)
    sleep, wake_up, discard = worker.sleep, worker.wake_up, worker.discard

    def _sleep(level: int = 1, **kwargs: Any) -> Any:
        result = sleep(level=level, **kwargs)
        worker.__dict__["_sleep_mode_backend"] = stand_in  # vLLM's GPU worker makes its backend at the first sleep
        if level >= 2:
            stand_in.discard()
        return result

    def _wake_up(tags: list[str] | None = None, **kwargs: Any) -> Any:
        if tags is None or "weights" in tags:
            stand_in.restore()
        return wake_up(tags=tags, **kwargs)

    def _discard(tags: Any, inner: Callable[..., Any] = discard) -> None:
        if "weights" in tuple(tags):
            stand_in.discard()
            return None
        return inner(tags)

    worker.__dict__.update(sleep=_sleep, wake_up=_wake_up, discard=_discard)
    return stand_in
