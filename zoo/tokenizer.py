"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then a few special ids."""
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    bos_id: int = 256
    eos_id: int = 257
    mask_id: int = 258  # reserved for the masked diffusion LM

    @property
    def min_vocab_size(self) -> int:
        return 259

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return ([self.bos_id] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Special and out-of-byte-range ids are dropped; broken UTF-8 shows as replacement characters."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
