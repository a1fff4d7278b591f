"""hwsync for TRL: ``from hwsync.trl import GRPOTrainer`` instead of ``from trl import GRPOTrainer``.

The one line gives TRL's own ``GRPOTrainer`` (GRPO, GSPO with ``importance_sampling_level="sequence"``, every TRL
option) whose weight sync into vLLM is :func:`hwsync.sync` (strategy ``auto``: adapter-only, expert LoRA included,
where the engine serves it; ``hybrid`` where it serves LoRA on some modules; ``full`` without LoRA), checked by
:func:`hwsync.verify` after every sync (``HWSYNC_VERIFY_EVERY``), with the rollouts generated through the synced
adapter. Options and defaults are the ms-swift plugin's (:class:`hwsync.integrations.options.SyncOptions`:
``HWSYNC_STRATEGY``, ``HWSYNC_BUCKET_MB``, ``HWSYNC_VERIFY_*``, ``HWSYNC_METRICS``, ``HWSYNC_SERVER`` /
``HWSYNC_TOKEN``), or pass ``hwsync_options=SyncOptions(...)``.

* **colocate** (``vllm_mode="colocate"``): TRL's in-process engine, built with LoRA serving sized for the trainer's
  adapter (``engine_kwargs=`` adds ``vllm.LLM`` arguments).
* **server** (``vllm_mode="server"``): hwsync's sync server runs inside ``trl vllm-serve`` (:func:`serve_args`:
  the flags to add; ``HWSYNC_SERVER`` / ``HWSYNC_TOKEN`` in both processes); TRL's client keeps generating over
  HTTP, with the synced adapter.

What changes and why (and the one scoped patch, ``trl_vllm_generation``): :mod:`hwsync.integrations.trl._trainer`;
``docs/trl.md``.
"""

from __future__ import annotations

from hwsync.common.errors import OptionError, UnsupportedSetupError
from hwsync.integrations.options import ENV, SyncOptions
from hwsync.integrations.trl._trainer import GRPOTrainer
from hwsync.integrations.vllm_serve import serve_args

__all__ = ["ENV", "GRPOTrainer", "OptionError", "SyncOptions", "UnsupportedSetupError", "serve_args"]
