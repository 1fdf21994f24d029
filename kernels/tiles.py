"""Tile-size arithmetic the Triton launch wrappers share."""


def padded(n: int, minimum: int = 16) -> int:
    """The power of two >= n and >= minimum: tl.arange needs powers of two, tl.dot needs every dimension >= 16."""
    return max(minimum, 1 << (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
