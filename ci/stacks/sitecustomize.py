"""Every thread's Python stack, every ``HWSYNC_STACKS_EVERY`` seconds, to stderr: what a hung GPU job was doing.

``ci/gpu.sh`` puts this folder first on ``PYTHONPATH`` when ``HWSYNC_STACKS_EVERY`` is set, so every Python process of
a part (``swift rlhf``, its engine, the examples) reports where it waits; the part's log keeps the dumps."""

import faulthandler
import os
import sys

_every = os.environ.get("HWSYNC_STACKS_EVERY")
if _every:
    faulthandler.dump_traceback_later(float(_every), repeat=True, file=sys.stderr)
