"""Trainer -> engine weight sync: strategies, manifest, buckets, receivers (see :func:`sync`).

Colocate (engine in the trainer's process)::

    report = hwsync.sync(llm, model)                 # strategy="auto": full / adapter / hybrid, reason in report
    hwsync.verify(llm, model, [[1, 2, 3, 4]])        # max |Δ logprob|, raises VerifyError above atol

Server mode (engine in another process)::

    # engine process                                 # trainer process
    hwsync.sync.serve(llm, "0.0.0.0:29555", token)   engine = hwsync.connect("host:29555", token)
                                                     hwsync.sync(engine, model)
"""
from __future__ import annotations

import sys
import types
from typing import Any

from hwsync.sync.api import Agreement, agreement, default_bucket_mb, sync, verify
from hwsync.sync.engine import Engine, LocalEngine, as_engine
from hwsync.sync.manifest import Bucket, Manifest, TensorSpec, plan_buckets
from hwsync.sync.payload import EngineInfo
from hwsync.sync.remote import RemoteEngine, SyncServer, connect, serve
from hwsync.sync.report import SyncReport

__all__ = [
    "Agreement",
    "Bucket",
    "Engine",
    "EngineInfo",
    "LocalEngine",
    "Manifest",
    "RemoteEngine",
    "SyncReport",
    "SyncServer",
    "TensorSpec",
    "agreement",
    "as_engine",
    "connect",
    "default_bucket_mb",
    "generate",
    "plan_buckets",
    "serve",
    "sync",
    "verify",
]


def generate(target, prompts, sampling_params=None, **kwargs):  # type: ignore[no-untyped-def]
    """``LLM.generate`` through hwsync: refuses on a stale engine, uses the synced adapter when one is served."""
    return as_engine(target).generate(prompts, sampling_params, **kwargs)


class _SyncModule(types.ModuleType):
    """``hwsync.sync`` is both this package and the function. Python binds ``hwsync.sync`` to the *package* as soon
    as any submodule is imported, so the package itself is callable (forwarding to :func:`hwsync.sync.api.sync`)
    and ``hwsync.sync.sync`` is the package too: ``hwsync.sync(llm, model)`` and ``hwsync.sync.verify(...)`` work
    whatever was imported first."""

    def __call__(self, target: Any, model: Any, **kwargs: Any) -> SyncReport:
        return _sync_function(target, model, **kwargs)


_sync_function = sync
sys.modules[__name__].__class__ = _SyncModule
sync = sys.modules[__name__]  # type: ignore[assignment]  # `from hwsync.sync import sync` -> the callable package
