"""``python -m hwsync <command>``: the same CLI as the ``hwsync`` console script."""

import sys

from hwsync.cli import main

sys.exit(main())
