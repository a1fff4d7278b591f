"""The options of hwsync's trainer integrations (ms-swift, TRL): one home, read from environment variables.

Trainers parse their own command lines into dataclasses and reject unknown flags (ms-swift), or are built by user
code (TRL), so the options travel as environment variables: they reach every process a launcher starts (trainer
ranks, rollout servers) and are validated once, when the trainer is built, so a typo fails before the first rollout
rather than at the first sync. Python callers may pass a :class:`SyncOptions` instead (TRL:
``hwsync.trl.GRPOTrainer(..., hwsync_options=...)``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hwsync.common.errors import HwsyncError, OptionError, SyncError
from hwsync.common.protocol import split_address
from hwsync.common.tokens import check_token
from hwsync.common.wire import Strategy

if TYPE_CHECKING:
    from hwsync.trainer.verify import Gate

__all__ = ["ENV", "OptionError", "SyncOptions"]

ENV: dict[str, str] = {
    "strategy": "HWSYNC_STRATEGY",
    "bucket_mb": "HWSYNC_BUCKET_MB",
    "verify_every": "HWSYNC_VERIFY_EVERY",
    "verify_atol": "HWSYNC_VERIFY_ATOL",
    "verify_prompts": "HWSYNC_VERIFY_PROMPTS",
    "verify_gate": "HWSYNC_VERIFY_GATE",
    "verify_logprobs_every": "HWSYNC_VERIFY_LOGPROBS_EVERY",
    "metrics_path": "HWSYNC_METRICS",
    "server": "HWSYNC_SERVER",
    "token": "HWSYNC_TOKEN",
}
"""Option field -> its variable (each registered, with its default and meaning, in :mod:`hwsync.common.config`)."""


@dataclass(frozen=True)
class SyncOptions:
    """What a trainer integration does at each weight sync (the same options and defaults for every trainer)."""

    strategy: str = "auto"
    """``auto`` | ``full`` | ``adapter`` | ``hybrid`` (see :func:`hwsync.sync`)."""
    bucket_mb: float | None = None
    """Transfer bucket size; ``None`` = hwsync's measured default for the device."""
    verify_every: int = 1
    """Check the engine after every N-th sync (0 = never): its content (exact; only what can have changed is read
    whole) and, per step, the rollout's own logprobs against the trainer's. A failed check stops training."""
    verify_atol: float | None = None
    """Unset (default): :func:`hwsync.verify`'s checks -- exact content fingerprints plus the logprob gate of the
    engine's device/dtype (:data:`hwsync.verify.GATES`), which a healthy bf16 GPU run passes. Set: also the strict
    check of earlier versions, max |Δ logprob| <= atol and equal greedy tokens (only where the engine computes like
    the trainer: vLLM's CPU build in fp32)."""
    verify_prompts: int = 2
    """How many of the first rollout batch's prompts the check uses (the same ones at every sync)."""
    metrics_path: str | None = None
    """JSONL file for per-sync / per-step records; ``None`` = ``<output_dir>/hwsync_metrics.jsonl``."""
    server: str | None = None
    """Server mode: ``host:port`` of hwsync's sync server in the rollout server's process (it listens, the trainer
    connects); with N data-parallel rollout engines (``swift rollout --vllm_data_parallel_size N``), N of them,
    comma-separated: engine k serves on the k-th, and the trainer feeds all N with one broadcast (:attr:`servers`)."""
    token: str | None = field(default=None, repr=False)
    """Server mode: the shared secret both sides read; requests signed with another token are refused."""
    verify_gate: Gate | None = None
    """``HWSYNC_VERIFY_GATE=mean,p90,prob[,max]``: the logprob gate instead of the platform's (see ``verify_atol``)."""
    verify_logprobs_every: int = 50
    """The check prompts' logprob comparison (one more engine call and trainer forwards, and the model's numerics
    spread the rollout check is read against) runs at the first check and then at every N-th (0 = the first only);
    the checks between read the content alone, the rollouts carry the logprob evidence of every step."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SyncOptions:
        """Options from ``HWSYNC_*`` variables (unset = default); :class:`OptionError` names the bad one."""
        from hwsync.trainer.api import parse_bucket_mb  # the trainer's parsers: not loaded by server_from_env
        from hwsync.trainer.verify import parse_gate

        env = os.environ if environ is None else environ

        def raw(field: str) -> str | None:
            value = env.get(ENV[field], "").strip()
            return value or None

        strategy = (raw("strategy") or "auto").lower()
        if strategy not in {s.value for s in Strategy}:
            raise OptionError(f"{ENV['strategy']}={strategy!r}: choose one of {', '.join(s.value for s in Strategy)}")
        return cls(
            strategy=strategy,
            bucket_mb=parse_bucket_mb(raw("bucket_mb")),
            verify_every=int(_number(raw("verify_every"), ENV["verify_every"], int, minimum=0, default=1) or 0),
            verify_atol=_number(raw("verify_atol"), ENV["verify_atol"], float, minimum=0.0, default=None),
            verify_prompts=int(
                _number(raw("verify_prompts"), ENV["verify_prompts"], int, minimum=1, default=2, exclusive=False) or 2
            ),
            metrics_path=raw("metrics_path"),
            server=_address(raw("server")),
            token=raw("token"),
            verify_gate=parse_gate(g, ENV["verify_gate"]) if (g := raw("verify_gate")) else None,
            verify_logprobs_every=int(
                _number(raw("verify_logprobs_every"), ENV["verify_logprobs_every"], int, minimum=0, default=50) or 0
            ),
        )

    @classmethod
    def server_from_env(cls, environ: Mapping[str, str] | None = None) -> SyncOptions:
        """Only the server-mode options (``HWSYNC_SERVER``, ``HWSYNC_TOKEN``), the rest default: what the engine
        process reads (``vllm serve``'s middleware), without loading the trainer's side of hwsync."""
        env = os.environ if environ is None else environ
        server, token = (env.get(ENV[k], "").strip() or None for k in ("server", "token"))
        return cls(server=_address(server), token=token)

    @property
    def servers(self) -> list[str]:
        """The addresses of :attr:`server`, one per data-parallel rollout engine."""
        return [a.strip() for a in self.server.split(",")] if self.server else []

    def server_credentials(self, setup: str, processes: str, not_port: str) -> tuple[str, str]:
        """``(address, token)`` for server mode; :class:`OptionError` saying what to set when either is missing,
        in the trainer's words: ``setup`` (e.g. ``--vllm_mode server``), the two ``processes`` that need the
        variables, and the port hwsync's must not be (``not_port``, e.g. ``swift's --port``)."""
        if not self.server or not self.token:
            missing = [ENV[k] for k in ("server", "token") if not getattr(self, k)]
            raise OptionError(
                f"{setup} with hwsync needs {' and '.join(missing)} in the environment of both {processes}: "
                f"{ENV['server']}=host:port (a free port for hwsync's sync server, not {not_port}) and "
                f"{ENV['token']}=<shared secret>, e.g. {ENV['token']}=$(hwsync token)"
            )
        try:
            return self.server, check_token(self.token)
        except SyncError as e:
            raise OptionError(f"{ENV['token']}: {e}") from None


def _address(text: str | None) -> str | None:
    """``host:port``, or several comma-separated (one per data-parallel engine), each once."""
    if text is None:
        return None
    addresses = [a.strip() for a in text.split(",")]
    for address in addresses:
        try:
            host, port = split_address(address)
        except HwsyncError:
            port = 0
        if not 0 < port < 65536:
            raise OptionError(
                f"{ENV['server']}={text!r}: write it as host:port, e.g. 127.0.0.1:29555, or one "
                "host:port per data-parallel rollout engine, comma-separated"
            )
    if len(set(addresses)) != len(addresses):
        raise OptionError(f"{ENV['server']}={text!r} names an address twice: one host:port per engine")
    return ",".join(addresses)


def _number(
    text: str | None, var: str, kind: type, *, minimum: float, default: float | None = None, exclusive: bool = False
) -> float | int | None:
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise OptionError(f"{var}={text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        raise OptionError(f"{var}={text!r}: must be a finite number {bound}")
    return value
