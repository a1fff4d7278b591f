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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_SCRIPT", "served_engine"]

ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    import hwsync
    from hwsync.testing import make_llm
    llm = make_llm(sys.argv[1], worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension", **json.loads(sys.argv[4]))
    with hwsync.serve(llm, "127.0.0.1:0", sys.argv[2], timeout_s=120) as server:
        print("HWSYNC_ADDRESS", server.address, flush=True)
        server.wait(timeout=float(sys.argv[3]))
    print("HWSYNC_BYE", flush=True)
""")


@contextlib.contextmanager
def served_engine(model_dir: str | os.PathLike[str], token: str, engine_kwargs: Mapping[str, Any], *,
                  env: Mapping[str, str] | None = None, serve_s: float = 600) -> Iterator[tuple[str, Any]]:
    """Start the engine process and yield ``(address, process)`` once it serves; on exit ask it to shut down (kill
    it if it does not). ``env`` is added to this process's environment plus :func:`~hwsync.testing.vllm_env` with
    the hwsync plugin (so every vLLM worker process, e.g. a TP engine's, loads it too)."""
    import hwsync
    from hwsync.testing.engine import vllm_env

    full_env = {**os.environ, **vllm_env(plugins=("hwsync",)), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(Path(model_dir)), token, str(serve_s),
                             json.dumps(dict(engine_kwargs))], env=full_env, stdout=subprocess.PIPE, text=True)
    address = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("HWSYNC_ADDRESS"):
            address = line.split()[1]
            break
    if address is None:
        proc.kill()
        raise RuntimeError(f"engine process exited ({proc.wait()}) before serving")
    # keep draining the engine's stdout (vLLM logs there): a full pipe would block the engine mid-sync
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    try:
        yield address, proc
    finally:
        if proc.poll() is None:
            try:
                hwsync.connect(address, token, timeout_s=30).shutdown()
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a hung engine is killed
                proc.kill()
                proc.wait()
