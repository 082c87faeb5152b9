"""Token attribute flags, bit for bit llama.cpp's `llama_token_attr`."""

from enum import IntFlag


class Attr(IntFlag):
    """Token attributes, bit for bit llama.cpp's `llama_token_attr`."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
