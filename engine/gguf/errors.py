"""The one exception the GGUF reader raises for anything wrong with a file or a split set."""


class GGUFError(ValueError):
    """A GGUF file (or split set) that cannot be read.

    The message always names the file and where the problem is (byte offset, key or tensor) and
    what was expected versus found, so a user can tell a truncated download from a bad converter.
    """
