"""Every ``HWSYNC_*`` environment variable hwsync reads: its name, default, parser and meaning, in one place.

Why environment variables: trainers parse their own command lines and reject unknown flags (ms-swift) or are built
by user code (TRL), and a launcher hands its environment to every process it starts (trainer ranks, rollout
servers, vLLM workers). Each variable is read where and when it acts (one set after import counts), through
:func:`read` or :func:`raw`; a name not registered here is an internal error, so a new variable cannot be read
without a home (``tests/test_config.py`` also finds every ``HWSYNC_*`` spelled in the package). The trainer
integrations' options (``HWSYNC_STRATEGY`` .. ``HWSYNC_TOKEN``) are validated together, with their bounds, by
:meth:`hwsync.integrations.options.SyncOptions.from_env`. The table of docs/configuration.md lists them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Variable", "VARIABLES", "raw", "read"]


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    """The value when unset (``""``: unset means "not given")."""
    parse: Callable[[str], Any]
    """Text -> value (the raw text where the reader validates it with more context)."""
    doc: str
    scope: str
    """Who reads it: ``trainer``, ``engine``, ``both`` or ``integrations``."""


def _unless_zero(value: str) -> bool:
    return value.strip() != "0"


def _names(value: str) -> frozenset[str]:
    return frozenset(n.strip() for n in value.split(",") if n.strip())


def _text(value: str) -> str:
    return value.strip()


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            "HWSYNC_BACKEND",
            "",
            _text,
            "device backend (cpu, cuda, npu, or a registered one) instead of the best available",
            "both",
        ),
        Variable(
            "HWSYNC_BUCKET_MB",
            "",
            _text,
            "transfer bucket size in MB (unset: the device's measured default)",
            "trainer",
        ),
        Variable(
            "HWSYNC_TIMEOUT_S",
            "600",
            float,
            "longest a data-plane transfer may stall, and a trainer waits for an answer, in seconds (read at import)",
            "both",
        ),
        Variable(
            "HWSYNC_GRAPHS",
            "1",
            _unless_zero,
            "0: never record a sync's device work as a graph (replayed launches)",
            "both",
        ),
        Variable(
            "HWSYNC_DIRECT",
            "1",
            _unless_zero,
            "0: every write through vLLM's reload path (A/B checks, baselines)",
            "engine",
        ),
        Variable("HWSYNC_DISABLE_PATCHES", "", _names, "comma-separated patch names (or all) never applied", "engine"),
        Variable("HWSYNC_STRATEGY", "auto", _text, "auto, full, adapter or hybrid", "integrations"),
        Variable(
            "HWSYNC_VERIFY_EVERY", "1", _text, "check the engine after every N-th sync (0: never)", "integrations"
        ),
        Variable(
            "HWSYNC_VERIFY_ATOL",
            "",
            _text,
            "a strict bound on max abs Δ logprob instead of the platform's gate",
            "integrations",
        ),
        Variable(
            "HWSYNC_VERIFY_PROMPTS", "2", _text, "prompts of the first rollout batch the check uses", "integrations"
        ),
        Variable(
            "HWSYNC_VERIFY_GATE",
            "",
            _text,
            "an explicit logprob gate (mean,p90,mean_prob,max), applied alone",
            "trainer",
        ),
        Variable(
            "HWSYNC_VERIFY_LOGPROBS_EVERY",
            "",
            _text,
            "the check prompts' logprobs at every N-th check (the rollouts carry the evidence in between)",
            "integrations",
        ),
        Variable("HWSYNC_METRICS", "", _text, "JSONL file for per-sync / per-step records", "integrations"),
        Variable(
            "HWSYNC_SERVER",
            "",
            _text,
            "server mode: host:port of hwsync's sync server (comma-separated for data-parallel engines)",
            "integrations",
        ),
        Variable(
            "HWSYNC_TOKEN", "", _text, "server mode: the shared secret (`hwsync token` makes one)", "integrations"
        ),
        Variable(
            "HWSYNC_VLLM_WEIGHT_ROUTES",
            "closed",
            _text,
            "`vllm serve` with hwsync's middleware: `closed` refuses vLLM's own unauthenticated weight routes (403); "
            "`open` leaves them to vLLM",
            "engine",
        ),
    )
}


def _variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"internal: {name} is not registered in hwsync.common.config.VARIABLES") from None


def raw(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The text of ``name`` (its default when unset)."""
    return (os.environ if environ is None else environ).get(name, _variable(name).default)


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of ``name``; a bad value raises :class:`~hwsync.common.errors.OptionError` naming it."""
    from hwsync.common.errors import OptionError

    text = raw(name, environ)
    try:
        return _variable(name).parse(text)
    except ValueError as e:
        raise OptionError(f"{name}={text!r}: {e} ({_variable(name).doc})") from None
