"""A server-mode engine for tests: ``vllm.LLM`` + :func:`hwsync.serve` in a process of its own, as a ``vllm serve``
deployment (or ``swift rollout``) runs it, with hwsync loaded through vLLM's plugin entry point (``VLLM_PLUGINS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_SCRIPT", "served_engine", "served_engines"]

ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import hwsync
    from hwsync.testing import make_llm
    llm = make_llm(sys.argv[1], worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension", **json.loads(sys.argv[3]))
    with hwsync.serve(llm, "127.0.0.1:0", os.environ.pop("HWSYNC_TOKEN"), timeout_s=120) as server:
        print("HWSYNC_ADDRESS", server.address, flush=True)
        server.wait(timeout=float(sys.argv[2]))
    print("HWSYNC_BYE", flush=True)
""")
"""The engine process: the token comes in its environment (``HWSYNC_TOKEN``), never on its command line, where any
local user could read it (``ps``)."""


@contextlib.contextmanager
def served_engine(
    model_dir: str | os.PathLike[str],
    token: str,
    engine_kwargs: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    serve_s: float = 600,
) -> Iterator[tuple[str, Any]]:
    """Start the engine process and yield ``(address, process)`` once it serves; on exit ask it to shut down (kill
    it if it does not). ``env`` is added to this process's environment plus :func:`~hwsync.testing.vllm_env` with
    the hwsync plugin (so every vLLM worker process, e.g. a TP engine's, loads it too)."""
    with served_engines(model_dir, token, [engine_kwargs], env=env, serve_s=serve_s) as served:
        yield served[0]


@contextlib.contextmanager
def served_engines(
    model_dir: str | os.PathLike[str],
    token: str,
    engine_kwargs: Sequence[Mapping[str, Any]],
    *,
    env: Mapping[str, str] | None = None,
    serve_s: float = 600,
    envs: Sequence[Mapping[str, str]] = (),
) -> Iterator[list[tuple[str, Any]]]:
    """:func:`served_engine` for several engines (one process each, one per ``engine_kwargs``), started side by
    side: data-parallel engines for one ``hwsync.connect([...])``. ``envs``: one more environment per engine (e.g.
    its ``CUDA_VISIBLE_DEVICES``). Yields ``[(address, process), ...]``."""
    from hwsync.testing.engine import vllm_env

    full_env = {
        **os.environ,
        **vllm_env(plugins=("hwsync",)),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
        "HWSYNC_TOKEN": token,
    }
    procs: list[subprocess.Popen[str]] = []
    served: list[tuple[str, Any]] = []
    try:
        for i, kwargs in enumerate(engine_kwargs):
            own = {**full_env, **(envs[i] if i < len(envs) else {})}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", ENGINE_SCRIPT, str(Path(model_dir)), str(serve_s), json.dumps(dict(kwargs))],
                    env=own,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            served.append((_address_of(proc), proc))
        yield served
    finally:
        for proc, (address, _) in zip(procs, served + [("", None)] * (len(procs) - len(served))):
            _stop(proc, address, token)


def _address_of(proc: subprocess.Popen[str]) -> str:
    """The address the engine process prints once it serves; then its stdout keeps being drained (vLLM logs there:
    a full pipe would block the engine mid-sync)."""
    assert proc.stdout is not None
    address = None
    for line in proc.stdout:
        if line.startswith("HWSYNC_ADDRESS"):
            address = line.split()[1]
            break
    if address is None:
        raise RuntimeError(f"engine process exited ({proc.wait()}) before serving")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return address


def _stop(proc: subprocess.Popen[str], address: str, token: str) -> None:
    """Ask the engine to shut down; kill it if it cannot be asked or does not."""
    import hwsync

    if proc.poll() is not None:
        return
    try:
        if not address:
            raise RuntimeError("never served")
        hwsync.connect(address, token, timeout_s=30).shutdown()
        proc.wait(timeout=60)
    except Exception:  # noqa: BLE001 - a hung engine is killed
        proc.kill()
        proc.wait()
