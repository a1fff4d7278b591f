#!/usr/bin/env bash
# ON THE GPU MACHINE, in the repository root, once every kit part sits in /tmp/gk:
#     (cd /tmp/gk && cat part.* | tar x) && bash /tmp/gk/kit/device-install.sh
# Installs the kit's wheels (vLLM, its small deps, ms-swift + deps, bitsandbytes) into /tmp/site, this repository
# (no deps) into /tmp/site2, writes /tmp/gk/env.sh and checks the result (check_env.py). After a code change, later
# calls on the same warm machine only need:   bash /tmp/gk/kit/device-install.sh --project   (seconds)
set -euo pipefail
GK="${GK:-/tmp/gk}"
if [ "${1:-}" != "--project" ]; then
    rm -rf /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$GK"/kit/*.whl
fi
rm -rf /tmp/site2 && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site2 .
# Console scripts (swift, vllm, hwsync): pip --target puts them in <target>/bin, but one carried wheel (rouge) ships a
# *package* named bin, after which pip skips the scripts of every later wheel. Write them from the entry points.
python3 - "$GK/bin" /tmp/site /tmp/site2 <<'PY'
import os, sys
from importlib import metadata
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for site in sys.argv[2:]:
    for dist in metadata.distributions(path=[site]):
        for ep in dist.entry_points.select(group="console_scripts"):
            module, _, attr = ep.value.partition(":")
            path = os.path.join(out, ep.name)
            with open(path, "w") as f:
                f.write("#!/usr/bin/env python3\nimport importlib, sys\n"
                        f"obj = importlib.import_module({module!r})\n"
                        f"for name in {attr.split('.')!r}:\n    obj = getattr(obj, name)\n"
                        "sys.exit(obj())\n")
            os.chmod(path, 0o755)
PY
cat > "$GK/env.sh" <<'ENV'
export PYTHONPATH=/tmp/site2:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/gk/bin:$PATH                          # hwsync, swift, vllm console scripts
export VLLM_USE_FLASHINFER_SAMPLER=0                   # flashinfer is not carried; vLLM's native sampler is used
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HWSYNC_BACKEND=cuda
for f in /tmp/gk/kit/vllm_ascend-*.tar.gz; do export HWSYNC_VLLM_ASCEND_SDIST=$f; done  # the released vllm-ascend
ENV
. "$GK/env.sh"
python3 "$GK/kit/check_env.py" ${1:+--quick}
