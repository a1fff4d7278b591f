"""On the GPU machine after device-install.sh: do the carried packages import and agree with the image's?

Prints one line per key package (version, where it was imported from), the GPUs, a bitsandbytes 4-bit round trip
on the GPU, and every requirement of a carried distribution that the combined environment does not satisfy (a
warning: the image's versions were not known when the kit was resolved). Exits 1 only when a key import fails.
"""
from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path

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

    print(f"  gpus          {torch.cuda.device_count()} x {torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}")
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
    for p in requirement_problems("/tmp/site"):
        print(f"  warning: {p}")
    print("device kit ok" if not failed else "device kit BROKEN")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
