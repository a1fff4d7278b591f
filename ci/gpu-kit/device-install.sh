#!/usr/bin/env bash
# ON THE GPU MACHINE, in the repository root, once every kit part sits in /tmp/gk (a variant: /tmp/gk-<vllm version>):
#     (cd /tmp/gk && cat part.* | tar x) && bash /tmp/gk/kit/device-install.sh
# Installs the kit's wheels (vLLM, its small deps, ms-swift + deps, bitsandbytes) into /tmp/site (a variant:
# /tmp/site-<vllm version>, from kit.env), this repository (no deps) into <site>-project, writes <gk>/env.sh and
# checks the result (check_env.py). After a code change, later calls on the same warm machine only need:
#     bash /tmp/gk/kit/device-install.sh --project   (seconds)
# Every wheel goes in with --no-deps: a vLLM that declares a newer torch than the image's (0.33.0: torch==2.14.0)
# runs on the image's torch 2.11 when its compiled ops load there (check_env.py imports and runs them).
set -euo pipefail
kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KIT_GK=/tmp/gk KIT_SITE=/tmp/site KIT_VLLM="" KIT_TORCH_PIN=""
# shellcheck source=/dev/null
[ -f "$kit/kit.env" ] && . "$kit/kit.env"
GK="${GK:-$KIT_GK}"
SITE="$KIT_SITE"
if [ "$SITE" = /tmp/site ]; then PROJECT=/tmp/site2; else PROJECT="$SITE-project"; fi
if [ "${1:-}" != "--project" ]; then
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$GK"/kit/*.whl
fi
rm -rf "$PROJECT" && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$PROJECT" .
# Console scripts (swift, vllm, hwsync): pip --target puts them in <target>/bin, but one carried wheel (rouge) ships a
# *package* named bin, after which pip skips the scripts of every later wheel. Write them from the entry points.
python3 - "$GK/bin" "$SITE" "$PROJECT" <<'PY'
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
cat > "$GK/env.sh" <<ENV
export PYTHONPATH=$PROJECT:$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$GK/bin:\$PATH                          # hwsync, swift, vllm console scripts
export VLLM_USE_FLASHINFER_SAMPLER=0                   # flashinfer is not carried; vLLM's native sampler is used
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HWSYNC_BACKEND=cuda
export HWSYNC_KIT_SITE=$SITE HWSYNC_KIT_VLLM=$KIT_VLLM HWSYNC_KIT_TORCH_PIN=$KIT_TORCH_PIN  # read by check_env.py
for f in $GK/kit/vllm_ascend-*.tar.gz; do export HWSYNC_VLLM_ASCEND_SDIST=\$f; done  # the released vllm-ascend
ENV
. "$GK/env.sh"
python3 "$GK/kit/check_env.py" ${1:+--quick}
