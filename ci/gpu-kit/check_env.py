"""On the GPU machine after device-install.sh: do the carried packages import and agree with the image's?

Prints one line per key package (version, where it was imported from), the GPUs, a bitsandbytes 4-bit round trip
on the GPU, vLLM's compiled ops loaded and run on the image's torch (vLLM declares the torch it was built with, e.g.
0.33.0: torch==2.14.0; its ops use torch's stable ABI, so the image's 2.11 may serve: this is where that is decided),
and every requirement of a carried distribution that the combined environment does not satisfy (a warning: the
image's versions were not known when the kit was resolved). Exits 1 when a key import or vLLM's ops fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

KEY = ["torch", "vllm", "transformers", "peft", "swift", "trl", "bitsandbytes", "msgspec", "hwsync"]


def requirement_problems(site: str) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.version import Version

    problems = []
    for dist in metadata.distributions(path=[site]):
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {req} (missing)")
                continue
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req} (have {have})")
    return sorted(set(problems))


def vllm_ops_work(torch: Any) -> bool:
    """Import vLLM's compiled op libraries as its CUDA platform does and run two ops against torch."""
    pin = os.environ.get("HWSYNC_KIT_TORCH_PIN") or "?"
    have = torch.__version__
    print(
        f"  vllm ops      vLLM {os.environ.get('HWSYNC_KIT_VLLM') or '?'} declares torch=={pin}; "
        f"running on the image's torch {have} (no-deps install)"
    )
    try:
        for lib in ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
            if importlib.util.find_spec(lib) is not None:
                importlib.import_module(lib)
                print(f"  vllm ops      {lib} loaded")
        from vllm import _custom_ops as ops

        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(256, device="cuda", dtype=torch.bfloat16) + 0.5
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-6)
        ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        err = (out.float() - ref).abs().max().item()
        g = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
        act = torch.empty(4, 256, device="cuda", dtype=torch.bfloat16)
        torch.ops._C.silu_and_mul(act, g)
        ref2 = torch.nn.functional.silu(g[:, :256].float()) * g[:, 256:].float()
        err2 = (act.float() - ref2).abs().max().item()
        ok = err < 5e-2 and err2 < 5e-2
        print(
            f"  vllm ops      rms_norm max |err| {err:.2e}, silu_and_mul max |err| {err2:.2e} (bf16): "
            f"{'ok' if ok else 'WRONG'}"
        )
        return ok
    except Exception as e:  # noqa: BLE001 - the verdict on this torch, printed in full
        print(f"  vllm ops      FAILED on torch {have}: {type(e).__name__}: {e} (carry torch=={pin}: README)")
        return False


def main() -> int:
    failed = False
    for name in KEY:
        try:
            mod = importlib.import_module(name)
            where = Path(getattr(mod, "__file__", "") or "?").parent
            print(f"  {name:<13} {getattr(mod, '__version__', '?'):<22} {where}")
        except Exception as e:  # noqa: BLE001 - report every failure, then exit 1
            failed = True
            print(f"  {name:<13} IMPORT FAILED: {type(e).__name__}: {e}")
    import torch

    print(
        f"  gpus          {torch.cuda.device_count()} x "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}"
    )
    if "--quick" not in sys.argv and torch.cuda.is_available():
        try:
            import bitsandbytes.functional as bnbf

            w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
            q, state = bnbf.quantize_4bit(w, quant_type="nf4")
            err = (bnbf.dequantize_4bit(q, state) - w).abs().max().item()
            print(f"  bnb nf4 round trip on cuda: max |err| {err:.3f} (4-bit: ~0.1-0.5 expected)")
        except Exception as e:  # noqa: BLE001
            failed = True
            print(f"  bitsandbytes on cuda FAILED: {type(e).__name__}: {e}")
    if "--quick" not in sys.argv and torch.cuda.is_available():
        failed |= not vllm_ops_work(torch)
    for p in requirement_problems(os.environ.get("HWSYNC_KIT_SITE", "/tmp/site")):
        print(f"  warning: {p}")
    print("device kit ok" if not failed else "device kit BROKEN")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
