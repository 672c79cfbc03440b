"""MXFP4 blocks (gpt-oss's experts) rewritten as Q5_0 blocks of the same values, at load.

An MXFP4 block (`ggml-common.h`: 17 bytes) is one E8M0 exponent byte `e` and 32 four-bit
codes, weight `j` = `KVALUES[code_j] * 2^(e - 128)` with `KVALUES` the doubled E2M1 values
(0, ±1, ±2, ±3, ±4, ±6, ±8, ±12). A Q5_0 block (22 bytes) holds `d` (fp16) and 32 five-bit
`q`, weight `d * (q - 16)`. With `d = 2^(e - 128)` and `q = KVALUES[code] + 16` (4 .. 28)
both say the same number, so the kernels' Q5_0 products compute MXFP4 products exactly, at
22/17 of the file's bytes.

`d` is exact in fp16 for `e` in 104 .. 143 (2^-24, fp16's least subnormal, to 2^15). A block
whose codes are all zero is zero whatever its `e` (llama.cpp writes `e = 0` for it); a block
with a smaller `e` and a nonzero code (every weight below 12 * 2^-25 in magnitude) becomes
zero, and is counted; a larger `e` (weights of 2^16 and more) is refused.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KVALUES", "MXFP4_BLOCK_BYTES", "Q5_0_BLOCK_BYTES", "RepackError", "to_q5_0"]

#: MXFP4's code -> weight in units of 2^(e - 128) (gguf-py's `MXFP4.kvalues`)
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)
MXFP4_BLOCK_BYTES = 17
Q5_0_BLOCK_BYTES = 22
#: the exponents whose 2^(e - 128) fp16 holds exactly
_E_MIN, _E_MAX = 104, 143


class RepackError(ValueError):
    """A block whose values Q5_0 cannot hold (an exponent above 143)."""


def _byte_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each byte of two codes (low nibble: weight j, high: weight j + 16): the Q5_0 low
    nibbles byte, the fifth bit of the low code's q, the fifth bit of the high code's q."""
    b = np.arange(256)
    q_lo = KVALUES[b & 15] + 16
    q_hi = KVALUES[b >> 4] + 16
    nibbles = ((q_lo & 15) | ((q_hi & 15) << 4)).astype(np.uint8)
    return nibbles, (q_lo >> 4).astype(np.uint8), (q_hi >> 4).astype(np.uint8)


_NIBBLES, _HIGH_LO, _HIGH_HI = _byte_tables()
#: fp16 bits of 2^(e - 128) for e in _E_MIN .. _E_MAX (0 elsewhere)
_D_BITS = np.zeros(256, dtype=np.uint16)
_D_BITS[_E_MIN:_E_MAX + 1] = np.ldexp(
    np.ones(_E_MAX - _E_MIN + 1), np.arange(_E_MIN, _E_MAX + 1) - 128).astype(
        np.float16).view(np.uint16)


def to_q5_0(blocks: np.ndarray, name: str = "tensor") -> tuple[np.ndarray, int]:
    """MXFP4 bytes (uint8, last dim a whole number of 17-byte blocks) as Q5_0 bytes of the
    same values (last dim 22 per block), and how many blocks were below fp16's range and
    became zero (module docstring); `RepackError` naming `name` for an exponent above 143."""
    arr = np.ascontiguousarray(blocks, dtype=np.uint8)
    if arr.ndim == 0 or arr.shape[-1] % MXFP4_BLOCK_BYTES:
        raise ValueError(f"{name}: MXFP4 rows hold whole {MXFP4_BLOCK_BYTES}-byte blocks, not "
                         f"{arr.shape[-1] if arr.ndim else 0} bytes")
    lead = arr.shape[:-1]
    b = arr.reshape(-1, MXFP4_BLOCK_BYTES)
    e, codes = b[:, 0], b[:, 1:]
    if (e > _E_MAX).any():
        raise RepackError(f"{name}: an MXFP4 block has exponent {int(e.max())} (weights of "
                          "2^16 or more), which ferrobatch's Q5_0 kernels cannot hold")
    nonzero = ((codes & 7) | ((codes >> 4) & 7)).any(axis=1)  # codes 0 and 8 are zero
    flushed = int(np.count_nonzero(nonzero & (e < _E_MIN)))
    out = np.empty((b.shape[0], Q5_0_BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = _D_BITS[e].astype("<u2").view(np.uint8).reshape(-1, 2)
    bits = np.concatenate([_HIGH_LO[codes], _HIGH_HI[codes]], axis=1)  # q's fifth bits, j 0..31
    out[:, 2:6] = np.packbits(bits, axis=1, bitorder="little")
    out[:, 6:] = _NIBBLES[codes]
    out[e < _E_MIN] = 0
    return out.reshape(*lead, -1), flushed
