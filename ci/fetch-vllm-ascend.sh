#!/usr/bin/env bash
# Puts vllm-ascend's released source (the PyPI sdist) where tests/test_vllm_ascend_released_code_on_cpu.py reads it.
#
# Why: vllm-ascend is published as an sdist only and cannot be installed without Ascend CANN, yet hwsync's Ascend
# loaders and its `vllm_ascend` patch must be tested against upstream's own code, not a reproduction of it. The test
# extracts the released functions from this tarball (nothing of it is copied into the repository).
#
# Why this recipe: a plain `pip download vllm-ascend` fails (its build dependencies pin triton-ascend==3.2.2, absent
# from PyPI, and setup.py asks `npu-smi` for the chip). Preparing its metadata without build isolation, with the chip
# given (SOC_VERSION) and kernels off, needs only setuptools + setuptools_scm, which live in a small build venv of
# their own so that the test venv is not touched.
#
# Idempotent: an existing tarball with the pinned sha256 is kept (a second run takes milliseconds).
#   usage: bash ci/fetch-vllm-ascend.sh [DEST_DIR]   (default: $HWSYNC_VENV or ./.venv, then /hwsync-cache/vllm-ascend)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION="0.23.0.post1"
SHA256="a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"
DEST="${1:-${HWSYNC_VENV:-$PWD/.venv}/hwsync-cache/vllm-ascend}"
TARBALL="$DEST/vllm_ascend-$VERSION.tar.gz"
PYTHON="${HWSYNC_PYTHON:-python3}"

have() { [[ -f "$TARBALL" ]] && [[ "$(sha256sum "$TARBALL" | cut -d' ' -f1)" == "$SHA256" ]]; }

if have; then
    echo "vllm-ascend $VERSION sdist: already at $TARBALL"
    exit 0
fi
mkdir -p "$DEST"
BUILD_VENV="$DEST/build-venv"
if [[ ! -x "$BUILD_VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$BUILD_VENV"
fi
# setuptools >= 70.1 has bdist_wheel built in (the venv's bundled 65.x does not, and metadata preparation needs it).
"$BUILD_VENV/bin/python" -m pip install --progress-bar off -q "setuptools>=70.1" setuptools_scm
SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 "$BUILD_VENV/bin/python" -m pip download --progress-bar off -q \
    --no-deps --no-build-isolation --no-binary vllm-ascend "vllm-ascend==$VERSION" -d "$DEST"
have || { echo "vllm-ascend sdist at $TARBALL is missing or does not have sha256 $SHA256" >&2; exit 1; }
echo "vllm-ascend $VERSION sdist: downloaded to $TARBALL"
