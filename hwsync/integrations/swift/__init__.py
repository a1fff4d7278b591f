"""hwsync for ms-swift: ``swift rlhf --rlhf_type grpo --external_plugins "$(hwsync plugin-path)" ...``.

Importing this package (ms-swift imports ``plugin.py`` for you through ``--external_plugins``; in Python code,
``import hwsync.swift`` before building the trainer) installs hwsync into ms-swift's GRPO pipeline:

* ``swift rlhf --rlhf_type grpo`` builds :class:`~hwsync.integrations.swift._trainer.HwsyncGRPOTrainer`, ms-swift's
  ``GRPOTrainer`` whose weight sync to vLLM is :func:`hwsync.sync` (strategy ``auto``/``full``/``adapter``/
  ``hybrid``), followed by :func:`hwsync.verify` every N syncs (GRPO and GSPO alike: the loss is ms-swift's);
* the patches whose probes fire on the installed vLLM / transformers / PEFT are applied (``hwsync doctor``).

Options are environment variables (``HWSYNC_STRATEGY``, ``HWSYNC_BUCKET_MB``, ``HWSYNC_VERIFY_EVERY``,
``HWSYNC_VERIFY_ATOL``, ``HWSYNC_VERIFY_PROMPTS``, ``HWSYNC_METRICS``; see :class:`SwiftOptions`). Per-sync and
per-step records go to a JSONL file (:mod:`hwsync.integrations.metrics`). Without the plugin ms-swift is untouched;
:func:`uninstall` restores it in-process.
"""

from __future__ import annotations

from hwsync.common.errors import OptionError, PluginError, UnsupportedSetupError
from hwsync.integrations.metrics import format_summary, read_metrics
from hwsync.integrations.swift._install import install, installed, uninstall
from hwsync.integrations.swift._options import ENV, SwiftOptions

__all__ = [
    "ENV",
    "OptionError",
    "PluginError",
    "SwiftOptions",
    "UnsupportedSetupError",
    "format_summary",
    "install",
    "installed",
    "read_metrics",
    "uninstall",
]

install()
