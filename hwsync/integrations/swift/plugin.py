"""The file to pass to ms-swift: ``--external_plugins "$(hwsync plugin-path)"`` (``swift rlhf`` and ``swift rollout``).

ms-swift imports this file by path and first puts its directory on ``sys.path``; it is taken off again so that the
modules next to it cannot shadow unrelated top-level imports. All the work happens in :mod:`hwsync.swift`.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import hwsync.integrations.swift  # noqa: E402

hwsync.integrations.swift.install()  # explicit: the package may already be imported (and uninstalled) in this process
