# shellcheck shell=bash
# Sourced by the ci/install*.sh scripts (after they set PY): one definition of "is this pin already installed".

# satisfied REQ... -> exit 0 when every `name==version` (or bare `name`) is installed in $PY at that version.
# Local version labels are ignored (torch 2.13.0+cpu satisfies torch==2.13.0).
satisfied() {
    "$PY" - "$@" <<'PYEOF'
import sys
from importlib import metadata
for req in sys.argv[1:]:
    name, _, want = req.partition("==")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if want and have.split("+")[0] != want:
        sys.exit(1)
PYEOF
}
