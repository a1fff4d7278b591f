"""ms-swift's view of hwsync's options (:mod:`hwsync.integrations.options`, the one home of the options and their
defaults)."""

from __future__ import annotations

from hwsync.integrations.options import ENV, SyncOptions

__all__ = ["ENV", "SWIFT_SERVER", "SwiftOptions"]

SwiftOptions = SyncOptions
"""The options as the ms-swift plugin reads them (the same class as every trainer integration's)."""

SWIFT_SERVER = ("--vllm_mode server", "`swift rollout` and `swift rlhf`", "swift's --port")
"""How :meth:`SyncOptions.server_credentials` names ms-swift's server-mode setup in its error."""
