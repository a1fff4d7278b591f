"""Other libraries' import-time noise, kept off hwsync's screen while hwsync itself causes it.

hwsync imports upstream modules on purpose where the user did not ask for them: a patch probe looks up its target
(``patches._base._import``: PEFT, vLLM's MoE layers, ms-swift, TRL), the tiny-MoE fixture writes a checkpoint. Those
imports print lines about the importing machine, not about hwsync's use of the library, and they were the first
thing ``hwsync doctor`` and the main job showed. :func:`quiet_imports` drops exactly those lines, for the block only:

* a logging filter on each logger of :data:`LOG_NOISE` (records under its level are dropped; errors always pass;
  loggers of other modules, hwsync's and the user's own are untouched), removed again when the block ends; a user
  who set the library's own logging variable (``LOG_LEVEL``, ``VLLM_LOGGING_LEVEL``, ``TORCH_LOGS``) sees them;
* a warnings filter for each message of :data:`WARNING_NOISE`, raised from that library's modules only, inside
  ``warnings.catch_warnings`` (the user's filters are restored as they were).

Each entry says why its line does not apply. Nothing here changes what any library does; it changes what it prints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["LogNoise", "WarningNoise", "LOG_NOISE", "WARNING_NOISE", "quiet_imports", "quiet_progress_bars"]


@dataclass(frozen=True)
class LogNoise:
    """Records of logger ``name`` (itself, not its children) under ``level`` are dropped (``message``: only those
    whose text starts with it); ``unless_env``: not when the user set that variable (the library's own logging
    switch)."""

    name: str
    level: int
    why: str
    unless_env: str = ""
    message: str = ""


@dataclass(frozen=True)
class WarningNoise:
    """Warnings of ``category`` whose message starts with ``message`` (a regex), raised from ``module``."""

    message: str
    category: type[Warning]
    module: str
    why: str


LOG_NOISE: tuple[LogNoise, ...] = (
    LogNoise(
        "bitsandbytes.backends.cpu.ops",
        logging.ERROR,
        "bitsandbytes' optional CPU gemm_4bit kernel from the `kernels` package; without it bitsandbytes uses "
        "its own CPU kernel. hwsync reaches bitsandbytes only through `import peft` (4-bit bases are the "
        "trainer's choice, made in the trainer's own import)",
    ),
    LogNoise(
        "torch._library.triton",
        logging.ERROR,
        "vLLM registers its Triton ops at import; on a machine without Triton (vLLM's CPU build) torch says it "
        "cannot look inside them. The CPU build never runs them",
        unless_env="TORCH_LOGS",
    ),
    LogNoise(
        "vllm.model_executor.layers.indexer_topk",
        logging.ERROR,
        "DeepSelect is the CUDA top-k of DeepSeek-V3.2's sparse-attention indexer, absent from vLLM's CPU wheel; "
        "a probe imports vLLM's layers, no DeepSeek-V3.2 model",
        unless_env="VLLM_LOGGING_LEVEL",
    ),
    LogNoise(
        "swift",
        logging.WARNING,
        "ms-swift logs at INFO on import (its built-in dataset registry); its warnings still show",
        unless_env="LOG_LEVEL",
    ),
    LogNoise(
        "DeepSpeed",
        logging.ERROR,
        "transformers' save_pretrained imports DeepSpeed (through accelerate) where it is installed, and "
        "DeepSpeed says it found no GPU; the tiny-MoE fixture writing a checkpoint runs no DeepSpeed",
        message="Setting accelerator to CPU",
    ),
)
"""Loggers whose import-time lines :func:`quiet_imports` drops."""

WARNING_NOISE: tuple[WarningNoise, ...] = (
    WarningNoise(
        r"TRL currently supports vLLM versions",
        UserWarning,
        r"trl(\.|$)",
        "TRL checks the installed vLLM against the range of its own vLLM integration each time a module "
        "of it imports (three times for one import). A patch probe imports TRL only to look up its target; "
        "hwsync checks vLLM against its own range (`hwsync doctor`: 'vllm range'), and hwsync.trl "
        "needs TRL 1.16, whose range the installed vLLM meets",
    ),
)
"""Warnings :func:`quiet_imports` drops."""


class _Drop(logging.Filter):
    def __init__(self, noise: LogNoise) -> None:
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.noise.level:
            return True
        return bool(self.noise.message) and not str(record.msg).startswith(self.noise.message)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """For the block: drop the lines of :data:`LOG_NOISE` and :data:`WARNING_NOISE` (around an import hwsync makes
    on purpose). Errors, other loggers and other warnings pass as before."""
    held: list[tuple[logging.Logger, _Drop]] = []
    for noise in LOG_NOISE:
        if noise.unless_env and os.environ.get(noise.unless_env):
            continue
        # A filter, not a level: libraries (re)set their loggers' levels while they import (ms-swift's get_logger,
        # vLLM's dictConfig); a logger's filters survive both. A fresh filter per block keeps nested blocks apart.
        logger, flt = logging.getLogger(noise.name), _Drop(noise)
        logger.addFilter(flt)
        held.append((logger, flt))
    try:
        with warnings.catch_warnings():
            for w in WARNING_NOISE:
                warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
            yield
    finally:
        for logger, flt in held:
            logger.removeFilter(flt)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """For the block: no transformers / huggingface_hub progress bars (a fixture's one-shard "Writing model shards"
    bar); switched back on afterwards only if they were on before."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_on = hf_logging.is_progress_bar_enabled()
    if was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
