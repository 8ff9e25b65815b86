"""Seeds derived from integers: one function every stage that samples shares (rollout, reward, eval)."""

from __future__ import annotations

import hashlib
import struct

_SEED_BITS = 62


def derive_seed(*parts: int) -> int:
    """A seed in [0, 2**62) from integers (blake2b of their 64-bit encodings): stable across runs and
    machines, and distinct for distinct parts (run seed, step, generation round, rank, prompt ...)."""
    data = b"".join(struct.pack("<q", int(p)) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> (64 - _SEED_BITS)


__all__ = ["derive_seed"]
