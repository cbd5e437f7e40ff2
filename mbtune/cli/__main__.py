"""``python -m mbtune.cli``: the ``mbtune`` command, exiting with :func:`mbtune.cli.main`'s code."""

import sys

from mbtune.cli import main

if __name__ == "__main__":
    sys.exit(main())
