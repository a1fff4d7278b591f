"""ms-swift's colocated engine seen through the ``vllm.LLM`` surface that :func:`hwsync.sync` drives.

ms-swift builds its colocated rollout engine as a bare ``vllm.v1.engine.llm_engine.LLMEngine``
(``trainer.engine.engine``), not a ``vllm.LLM``. The sync engine needs five things of an in-process engine
(``llm_engine``, ``collective_rpc``, ``reset_prefix_cache``, ``generate``, ``add_lora``-free access to the
worker); an ``LLMEngine`` has all of them except ``generate``, which is the add-request / step loop ``LLM``
itself runs. This view supplies that loop and forwards the rest, so no engine is copied or wrapped twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hwsync.common import foreign

__all__ = ["LLMEngineView"]

_ids = itertools.count()


class LLMEngineView:
    """Duck-typed ``vllm.LLM`` over an existing in-process ``LLMEngine`` (ms-swift colocate mode)."""

    def __init__(self, engine: Any) -> None:
        self.llm_engine = engine

    @classmethod
    def of(cls, engine: Any) -> LLMEngineView:
        """The one view of ``engine`` (so :func:`hwsync.as_engine` hands every caller the same handle and lock)."""
        view: LLMEngineView | None = foreign.held(engine, "view")
        if view is None:
            view = foreign.state_of(engine)["view"] = cls(engine)
        return view

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self.llm_engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        return self.llm_engine.reset_prefix_cache(*args, **kwargs)

    def generate(
        self, prompts: Sequence[Any], sampling_params: Any = None, *, lora_request: Any = None, use_tqdm: bool = False
    ) -> list[Any]:
        """Run ``prompts`` to completion; outputs in prompt order (what ``LLM.generate`` returns)."""
        from vllm import SamplingParams

        engine = self.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine is busy with other requests; sync and verify between rollouts")
        params = sampling_params if sampling_params is not None else SamplingParams()
        order = {}
        for i, prompt in enumerate(prompts):
            rid = f"hwsync-verify-{next(_ids)}"  # outputs carry this (external) id, not the internal one returned
            engine.add_request(rid, prompt, params, lora_request=lora_request)
            order[rid] = i
        done: dict[int, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in order:
                    done[order[out.request_id]] = out
        if len(done) != len(order):
            raise RuntimeError(f"engine finished {len(done)} of {len(order)} requests")
        return [done[i] for i in range(len(order))]
