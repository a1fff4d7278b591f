#!/usr/bin/env bash
# Build, on a CPU machine with network, the kit that puts vLLM 0.32.0 (CUDA 13), ms-swift 4.6.0 and bitsandbytes on
# a GPU machine whose image has torch 2.11 (cu130), transformers 5.17, peft 0.21, triton 3.6 -- and no network.
#
#   bash ci/gpu-kit/build.sh                       # from the repository root; ~1 min the first time, seconds cached
#   VLLM_VERSION=0.33.0 bash ci/gpu-kit/build.sh   # the same kit around vLLM 0.33.0 (a variant, see below)
#
# Makes .gpukit/ (git-ignored): part.00 .. part.NN (58 MiB each: a device call carries at most 64 MiB beside the
# repository) and send/, the one folder each device call carries (ci/gpu-kit/stage.sh fills it). Downloads are
# cached in .gpukit/cache, so a rebuild only re-packs. See ci/gpu-kit/README.md for the device calls.
#
# A VLLM_VERSION other than the default builds a variant: its parts go to .gpukit/vllm-<version>/ (the default kit's
# stay), and on the device it unpacks into /tmp/gk-<version> and installs into /tmp/site-<version> (kit.env inside
# the kit says so), so both can sit on one machine. Its small deps are vllm-deps.txt plus vllm-deps-<version>.txt
# (what that release requires beyond the list). torch is never carried: vLLM's compiled ops use torch's stable ABI,
# and device-install.sh checks that they load and compute on the image's torch (check_env.py).
#
# How the set of wheels is chosen: one pip resolution (python 3.12, as on the device) of vllm-deps.txt +
# swift-deps.txt against a stand-in torch (so no CUDA torch is fetched) and the image's transformers/peft versions;
# every resolved distribution the image already has (image-packages.txt) is left out; the rest is fetched as a
# manylinux/pure wheel, or built here from its sdist when PyPI has no wheel (pure-Python packages).
set -euo pipefail
DEFAULT_VLLM=0.32.0
VLLM_VERSION="${VLLM_VERSION:-$DEFAULT_VLLM}"
BNB_VERSION="${BNB_VERSION:-0.50.2}"      # the first line of wheels with libbitsandbytes_cuda130 (CUDA 13, torch 2.11)
IMAGE_TRANSFORMERS="${IMAGE_TRANSFORMERS:-5.17.0}"
SWIFT_VERSION="${SWIFT_VERSION:-4.6.0}"
PEFT_FOR_SWIFT="${PEFT_FOR_SWIFT:-}"     # empty: the image's peft 0.21 serves ms-swift (see README); else carry it
PART_SIZE="${PART_SIZE:-58m}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -f pyproject.toml ] && [ -e .git ] || { echo "run from the repository root (a git checkout)"; exit 1; }
is312() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; }
PY="${PYTHON312:-}"
if [ -z "$PY" ]; then
    for cand in python3.12 python3 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        if is312 "$cand"; then PY="$cand"; break; fi
    done
fi
[ -n "$PY" ] && is312 "$PY" \
    || { echo "needs a python3.12 (the device's Python) to resolve and build wheels: set PYTHON312=/path/to/python3.12"; exit 1; }

C="$PWD/.gpukit/cache"  # shared by every variant
if [ "$VLLM_VERSION" = "$DEFAULT_VLLM" ]; then
    K="$PWD/.gpukit"; DEVICE_GK=/tmp/gk; DEVICE_SITE=/tmp/site
else
    K="$PWD/.gpukit/vllm-$VLLM_VERSION"; DEVICE_GK="/tmp/gk-$VLLM_VERSION"; DEVICE_SITE="/tmp/site-$VLLM_VERSION"
fi
mkdir -p "$C/dl" "$C/built" "$C/standin/src/torch"
rm -rf "$K/kit" "$K"/part.* && mkdir -p "$K/kit"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform any)
norm() { tr 'A-Z_.' 'a-z--'; }

echo "[kit] vllm==$VLLM_VERSION (CUDA 13 wheel, ~330 MB download the first time)"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$C/dl" "vllm==$VLLM_VERSION"
whl=$(ls "$C"/dl/vllm-"$VLLM_VERSION"-*.whl)
torch_pin=$(unzip -p "$whl" '*/METADATA' | sed -n 's/^Requires-Dist: torch==\([0-9.]*\).*/\1/p' | head -1)
# Trim what a Hopper test run never loads: FlashAttention-2 (pre-Hopper), the Rust server binary, FlashMLA/KDA.
cp "$whl" "$K/kit/"
zip -q -d "$K/kit/$(basename "$whl")" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
    'vllm/_flashmla_C.abi3.so' 'vllm/_flashmla_extension_C.abi3.so' 'vllm/_flashkda_C.abi3.so' >/dev/null 2>&1 || true

echo "[kit] resolving vLLM's small deps + ms-swift against a stand-in torch==$torch_pin and transformers==$IMAGE_TRANSFORMERS"
if ! ls "$C"/standin/torch-"$torch_pin"+standin-*.whl >/dev/null 2>&1; then
    printf 'from setuptools import setup\nsetup(name="torch", version="%s+standin", packages=["torch"])\n' \
        "$torch_pin" > "$C/standin/src/setup.py"
    : > "$C/standin/src/torch/__init__.py"
    (cd "$C/standin/src" && "$PY" -m pip wheel -q --no-deps -w "$C/standin" . >/dev/null)
fi
# ms-swift itself is carried without its dependency list, which pins peft<0.21: its other requirements are resolved
# with the peft pin replaced by the peft the device will use (the image's 0.21 unless PEFT_FOR_SWIFT is set)
"$PY" -m pip download -q --no-deps -d "$C/dl" "ms-swift==$SWIFT_VERSION" >/dev/null
unzip -p "$C"/dl/ms_swift-"$SWIFT_VERSION"-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | sed "s/^peft[<>=!,.0-9 ]*\$/peft==${PEFT_FOR_SWIFT:-0.21.0}/" > "$C/swift-reqs.txt"
deps=("$here/vllm-deps.txt")
[ -f "$here/vllm-deps-$VLLM_VERSION.txt" ] && deps+=("$here/vllm-deps-$VLLM_VERSION.txt")
{ grep -hv '^#' "${deps[@]}" "$here/swift-deps.txt"; cat "$C/swift-reqs.txt"; echo "bitsandbytes==$BNB_VERSION"; } \
    | grep . > "$C/req.txt"
printf 'torch==%s+standin\ntransformers==%s\n' "$torch_pin" "$IMAGE_TRANSFORMERS" > "$C/constraints.txt"
key=$(cat "$C/req.txt" "$C/constraints.txt" | sha1sum | cut -c1-16)
report="$C/report-$key.json"
if [ ! -f "$report" ]; then  # the resolution (~1 min) only when its inputs change (one report per variant's inputs)
    "$PY" -m pip install -q --dry-run --ignore-installed --no-cache-dir --find-links "$C/standin" \
        --report "$report" -r "$C/req.txt" -c "$C/constraints.txt" >/dev/null
fi
"$PY" - "$report" > "$C/pins.txt" <<'PY'
import json, sys
for item in json.loads(open(sys.argv[1]).read())["install"]:
    m = item["metadata"]
    print(f"{m['name']}=={m['version']}")
PY
echo "ms-swift==$SWIFT_VERSION" >> "$C/pins.txt"

echo "[kit] fetching what the image lacks ($(wc -l < "$C/pins.txt") resolved, image has $(grep -vc '^#' "$here/image-packages.txt") packages)"
carried=()
find_wheel() {  # the cached wheel of "name==version" (file names vary in case and separators)
    local pat; pat="/$(echo "${1%%==*}" | sed 's/[-_.]/[-_.]/g')-${1##*==}-[^/]*\.whl\$"
    ls "$C"/dl/*.whl "$C"/built/*.whl 2>/dev/null | grep -i "$pat" | head -1 || true
}
need=()
while read -r pin; do
    name=$(echo "${pin%%==*}" | norm)
    case "$name" in torch|vllm) continue ;; esac
    if [ "$name" != "$(echo "${PEFT_FOR_SWIFT:+peft}" | norm)" ] && grep -qx "$name" "$here/image-packages.txt"; then
        continue
    fi
    carried+=("$pin")
    [ -n "$(find_wheel "$pin")" ] || need+=("$pin")
done < "$C/pins.txt"
if [ "${#need[@]}" -gt 0 ] && ! "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$C/dl" "${need[@]}" >/dev/null 2>&1; then
    for pin in "${need[@]}"; do  # one of them has no wheel: fetch one by one, build the sdist-only ones here
        [ -n "$(find_wheel "$pin")" ] && continue
        if ! "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$C/dl" "$pin" >/dev/null 2>&1; then
            echo "[kit]   $pin: no wheel on PyPI, building it from the sdist"
            "$PY" -m pip wheel -q --no-deps --no-cache-dir -w "$C/built" "$pin" >/dev/null
        fi
    done
fi
for pin in "${carried[@]}"; do
    f=$(find_wheel "$pin")
    [ -n "$f" ] || { echo "[kit] no wheel for $pin"; exit 1; }
    cp "$f" "$K/kit/"
done
# bitsandbytes: keep the CPU and CUDA 13 libraries (43 MB -> ~9 MB)
bnb=$(ls "$K"/kit/bitsandbytes-"$BNB_VERSION"-*.whl)
zip -q -d "$bnb" 'bitsandbytes/libbitsandbytes_cuda1[12]*.so' 'bitsandbytes/libbitsandbytes_rocm*.so' \
    'bitsandbytes/libbitsandbytes_xpu*.so' >/dev/null 2>&1 || true
# (grep without -q: under pipefail an early exit of grep -q kills unzip with SIGPIPE and fails the check at random)
unzip -l "$bnb" | grep 'libbitsandbytes_cuda130.so' >/dev/null || { echo "[kit] $bnb has no CUDA 13.0 library"; exit 1; }

# vllm-ascend's released sdist, which tests/test_vllm_ascend_released_code_on_cpu.py reads (the device has no network;
# env.sh points HWSYNC_VLLM_ASCEND_SDIST at it)
bash "$here/../fetch-vllm-ascend.sh" "$C/vllm-ascend" >/dev/null
cp "$C"/vllm-ascend/vllm_ascend-*.tar.gz "$K/kit/"
cp "$here/device-install.sh" "$here/check_env.py" "$K/kit/"
printf '%s\n' "${carried[@]}" | sort > "$K/kit/CARRIED.txt"
echo "vllm==$VLLM_VERSION" >> "$K/kit/CARRIED.txt"
# where this kit lives on the device (read by device-install.sh)
printf 'KIT_VLLM=%s\nKIT_TORCH_PIN=%s\nKIT_GK=%s\nKIT_SITE=%s\n' \
    "$VLLM_VERSION" "$torch_pin" "$DEVICE_GK" "$DEVICE_SITE" > "$K/kit/kit.env"
(cd "$K" && tar cf kit.tar kit && split -b "$PART_SIZE" -d kit.tar part. && rm -rf kit.tar kit)
(cd "$K" && cat part.* | tar t > /dev/null) || { echo "[kit] the parts do not re-assemble into a tar"; exit 1; }
n=$(ls "$K"/part.* | wc -l)
stage="bash ci/gpu-kit/stage.sh i"
[ "$VLLM_VERSION" = "$DEFAULT_VLLM" ] || stage="VLLM_VERSION=$VLLM_VERSION $stage"
echo "[kit] vllm $VLLM_VERSION: $n parts in ${K#"$PWD"/} ($(du -ch "$K"/part.* | tail -1 | cut -f1)), $(( ${#carried[@]} + 1 ))" \
    "wheels; unpacks to $DEVICE_GK on the device; stage part i: $stage"
