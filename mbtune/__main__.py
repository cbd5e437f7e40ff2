"""``python -m mbtune``: the ``mbtune`` command."""

from mbtune.cli import console

if __name__ == "__main__":
    console()
