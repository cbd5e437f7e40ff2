"""The one exception type the command line turns into a clean error."""

__all__ = ["MbtuneError"]


class MbtuneError(ValueError):
    """Bad input. ``str()`` is the one line the user sees; the CLI exits with code 2."""
