"""TurboQuant's codec: random rotation + Lloyd-Max scalar codes (pure MLX and numpy).

Zandieh et al. 2025, "TurboQuant", the MSE variant. Each key or value vector x (one head,
one token) is stored as
    codes   b-bit index per coordinate of  sqrt(d) * R x / ||x||  into the Lloyd-Max
            codebook of N(0, 1), packed into uint32 words (3 and 5 bits straddle words)
    scale   one float16: ||x|| * sqrt(d) / ||codebook values||, so the reconstruction
            is exactly as long as x (removes the MSE quantizer's shrinkage of |q.k|)
R is a seeded random orthogonal map: random signs then the normalised Walsh-Hadamard
transform for power-of-two head dims, a dense random orthogonal matrix otherwise. After
R every coordinate of a unit vector has the same law (Beta, ~N(0, 1/d)) whatever x is:
outlier channels are spread over all coordinates and one data-free codebook serves all
vectors, with no per-group scales or zero points.

Bits (`--kv-bits` is the nominal bits per coordinate, averaged over K and V):
    bits=4: K 5, V 3    bits=3: K 4, V 2    bits=2: K 2, V 2
Keys get more bits than values: a key error moves a softmax logit and is scaled by |q|;
a value error is averaged over the attended tokens (bench/RESULTS.md#turboquant-bit-split).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

# --------------------------------------------------------------------------------------
# Codebooks
# --------------------------------------------------------------------------------------

# Positive half of the Lloyd-Max (MSE-optimal) reconstruction levels for N(0, 1); the
# codebooks are symmetric. Computed by `lloyd_max_codebook(bits)` (Lloyd's iteration,
# centroid <-> midpoint, to 1e-10, with the Gaussian's mass and first moment integrated
# on a fine grid) and rounded to 7 digits. The rotated, sqrt(d)-scaled coordinates of a
# unit vector tend to N(0, 1) as d grows: at d = 64 the exact (Beta) codebook's outer
# levels are ~3% smaller, and measured no better on real or synthetic data.
# Expected squared error of a unit vector (d x per-coordinate MSE): 0.3634 (1),
# 0.1175 (2), 0.03455 (3), 0.009501 (4), 0.002505 (5); the paper (Theorem 1) rounds
# these to ~0.36, 0.117, 0.03, 0.009.
CODEBOOKS = {
    1: (0.7978846,),
    2: (0.4527800, 1.5104176),
    3: (0.2450942, 0.7560053, 1.3439093, 2.1519457),
    4: (
        0.1283950, 0.3880483, 0.6567591, 0.9423405,
        1.2562312, 1.6180464, 2.0690172, 2.7325896,
    ),
    5: (
        0.0658897, 0.1980518, 0.3313783, 0.4666995, 0.6049336, 0.7471357,
        0.8945651, 1.0487833, 1.2118044, 1.3863403, 1.5762281, 1.7872332,
        2.0287284, 2.3177394, 2.6911196, 3.2607325,
    ),
}  # fmt: skip

SUPPORTED_BITS = tuple(CODEBOOKS)



def _coordinate_density(dim: Optional[int]):
    """(grid, density) of one sqrt(dim)-scaled coordinate of a random unit vector."""
    if dim is None:
        z = np.linspace(-12.0, 12.0, 200_001)
        return z, np.exp(-0.5 * z * z)
    if dim < 3:
        raise ValueError(f"dim must be >= 3 for the Beta codebook, got {dim}")
    r = math.sqrt(dim)
    z = np.linspace(-r, r, 200_001)
    return z, np.clip(1.0 - z * z / dim, 0.0, None) ** ((dim - 3) / 2)


def lloyd_max_codebook(bits: int, dim: Optional[int] = None, tol: float = 1e-10):
    """Lloyd-Max levels (ascending, float64) for one rotated coordinate.

    `dim=None` is the Gaussian limit N(0, 1) (what `CODEBOOKS` holds); an integer `dim`
    gives the exact distribution of sqrt(dim) * u_1 for u uniform on the unit sphere
    (density proportional to (1 - z^2 / dim) ** ((dim - 3) / 2)).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    z, pdf = _coordinate_density(dim)
    # Cumulative mass and first moment on the grid (trapezoid rule), so that each Lloyd
    # step is two interpolations instead of a numerical integral per interval.
    dz = np.diff(z)
    mass = np.concatenate([[0.0], np.cumsum(0.5 * (pdf[1:] + pdf[:-1]) * dz)])
    zp = z * pdf
    moment = np.concatenate([[0.0], np.cumsum(0.5 * (zp[1:] + zp[:-1]) * dz)])
    n = 2**bits
    levels = np.linspace(-2.0, 2.0, n) * (1.0 if n > 2 else 0.5)
    for _ in range(100_000):
        edges = np.concatenate([[z[0]], (levels[1:] + levels[:-1]) / 2, [z[-1]]])
        m = np.interp(edges, z, mass)
        s = np.interp(edges, z, moment)
        new = np.diff(s) / np.diff(m)
        done = np.max(np.abs(new - levels)) < tol
        levels = new
        if done:
            break
    return levels


def codebook(bits: int) -> np.ndarray:
    """The full symmetric N(0, 1) codebook for `bits` (ascending, float32)."""
    if bits not in CODEBOOKS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    half = np.asarray(CODEBOOKS[bits], dtype=np.float32)
    return np.concatenate([-half[::-1], half])


@lru_cache(maxsize=None)
def codebook_arrays(bits: int) -> Tuple[mx.array, mx.array]:
    levels = codebook(bits)
    return mx.array(levels), mx.array((levels[1:] + levels[:-1]) / 2)


# --------------------------------------------------------------------------------------
# Bit packing: b-bit codes <-> uint32 words, b in 1..8 (3 and 5 bits straddle words)
# --------------------------------------------------------------------------------------


def _packing(bits: int):
    """Codes per group, words per group: a group of codes fills whole uint32 words."""
    g = math.gcd(bits, 32)
    return 32 // g, bits // g


def packed_words(count: int, bits: int) -> int:
    """uint32 words needed for `count` codes of `bits` bits."""
    per_group, words = _packing(bits)
    return -(-count // per_group) * words


@lru_cache(maxsize=None)
def _pack_layout(bits: int):
    per_group, n_words = _packing(bits)
    pos = np.arange(per_group) * bits
    word = pos // 32
    shift = pos % 32
    straddle = shift + bits > 32
    return per_group, n_words, word, shift, straddle


@lru_cache(maxsize=None)
def _shifts(bits: int, start: int, stop: int) -> mx.array:
    """Bit offsets of codes start..stop-1 in their words (made once, not per call)."""
    return mx.array(_pack_layout(bits)[3][start:stop], dtype=mx.uint32)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes (..., n) in [0, 2**bits) into uint32 words (..., words)."""
    per_group, n_words, word, shift, straddle = _pack_layout(bits)
    n = codes.shape[-1]
    codes = codes.astype(mx.uint32)
    pad = -n % per_group
    if pad:
        codes = mx.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    codes = codes.reshape(*codes.shape[:-1], -1, per_group)
    lo = codes << _shifts(bits, 0, per_group)  # bits past 31 fall off
    words = []
    for j in range(n_words):
        # Bits of different codes never overlap, so a sum is a bitwise or.
        start, stop = np.searchsorted(word, [j, j + 1])
        w = mx.sum(lo[..., int(start) : int(stop)], axis=-1)
        carry = np.nonzero(straddle & (word == j - 1))[0]
        if carry.size:
            i = int(carry[0])
            w = w + (codes[..., i] >> int(32 - shift[i]))
        words.append(w)
    return mx.stack(words, axis=-1).reshape(*codes.shape[:-2], -1)


def unpack_codes(words: mx.array, bits: int, count: int) -> mx.array:
    """Inverse of `pack_codes`: uint32 words -> uint32 codes (..., count)."""
    per_group, n_words, word, shift, straddle = _pack_layout(bits)
    words = words.reshape(*words.shape[:-1], -1, n_words)
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    # Broadcast shifts over each word's own codes (static slices, no gathers: a
    # gather along the last axis is ~10x slower on CPU).
    parts = []
    for j in range(n_words):
        start, stop = (int(i) for i in np.searchsorted(word, [j, j + 1]))
        w = words[..., j : j + 1]
        codes = w >> _shifts(bits, start, stop)
        if straddle[stop - 1]:
            # The last code of this word continues in the next one.
            s = int(shift[stop - 1])
            top = (w >> s) | (words[..., j + 1 : j + 2] << (32 - s))
            codes = mx.concatenate([codes[..., :-1], top], axis=-1)
        parts.append(codes)
    codes = parts[0] if n_words == 1 else mx.concatenate(parts, axis=-1)
    codes = (codes & mask).reshape(*codes.shape[:-2], -1)
    return codes[..., :count] if codes.shape[-1] != count else codes


# --------------------------------------------------------------------------------------
# Rotation
# --------------------------------------------------------------------------------------


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Rotation:
    """A seeded random orthogonal map on the last axis (float32 in, float32 out).

    Power-of-two dims: x -> H (s * x) / sqrt(d), s random signs, H the Walsh-Hadamard
    matrix (mx.hadamard_transform, O(d log d)). Other dims: a dense Haar-random
    orthogonal matrix (QR of a seeded Gaussian matrix).
    """

    def __init__(self, dim: int, seed: int):
        rng = np.random.default_rng(seed)
        self.dim = dim
        self.hadamard = _is_power_of_two(dim)
        if self.hadamard:
            signs = rng.integers(0, 2, size=dim) * 2 - 1
            self.signs = mx.array(signs.astype(np.float32))
            self.matrix = None
        else:
            q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
            q = q * np.sign(np.diag(r))  # makes the QR factor Haar-distributed
            self.signs = None
            self.matrix = mx.array(q.astype(np.float32))

    @classmethod
    def from_signs(cls, signs: mx.array) -> "Rotation":
        """The Hadamard rotation with these signs (what a kernel is handed)."""
        rot = cls.__new__(cls)
        rot.dim, rot.hadamard, rot.signs, rot.matrix = signs.shape[0], True, signs, None
        return rot

    def forward(self, x: mx.array) -> mx.array:
        if self.hadamard:
            return mx.hadamard_transform(x * self.signs)
        return x @ self.matrix.T

    def inverse(self, y: mx.array) -> mx.array:
        if self.hadamard:
            return mx.hadamard_transform(y) * self.signs
        return y @ self.matrix


@lru_cache(maxsize=None)
def rotation(dim: int, seed: int) -> Rotation:
    """Shared per (dim, seed): copies share it and a loaded cache rebuilds it."""
    return Rotation(dim, seed)


# --------------------------------------------------------------------------------------
# Codec
# --------------------------------------------------------------------------------------


_FLOAT16_MAX = 65504.0


def quantize(x: mx.array, bits: int, rot: Rotation) -> Tuple[mx.array, mx.array]:
    """Encode x (..., d) -> (packed codes (..., words) uint32, scales (...) float16).

    The stored "norm" is the scale that makes the reconstruction as long as x
    (||x|| * sqrt(d) / ||codebook values||), which removes the MSE quantizer's shrinkage
    of |q.k| at no extra bytes (bench: lower attention error than the raw norm).
    """
    dim = x.shape[-1]
    levels, edges = codebook_arrays(bits)
    x = x.astype(mx.float32)
    norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
    y = rot.forward(x / mx.maximum(norm, 1e-30)) * math.sqrt(dim)
    codes = mx.sum(y[..., None] > edges, axis=-1).astype(mx.uint32)
    c = mx.take(levels, codes)
    c_norm = mx.sqrt(mx.sum(c * c, axis=-1, keepdims=True))
    scale = norm * math.sqrt(dim) / mx.maximum(c_norm, 1e-30)
    scale = mx.minimum(scale, _FLOAT16_MAX)  # never inf, whatever the activations
    return pack_codes(codes, bits), scale.squeeze(-1).astype(mx.float16)


def levels(words: mx.array, bits: int, dim: int) -> mx.array:
    """Packed codes -> their codebook values (float32, not yet scaled)."""
    table, _ = codebook_arrays(bits)
    return mx.take(table, unpack_codes(words, bits, dim))


def dequantize_rotated(
    words: mx.array, norms: mx.array, bits: int, dim: int
) -> mx.array:
    """Codes -> float32 vectors in the rotated domain (R x)."""
    c = levels(words, bits, dim)
    return c * (norms.astype(mx.float32)[..., None] * (1.0 / math.sqrt(dim)))


def dequantize(
    words: mx.array, norms: mx.array, bits: int, rot: Rotation, dtype=mx.float32
) -> mx.array:
    """Codes -> vectors (..., d) in `dtype`."""
    return rot.inverse(dequantize_rotated(words, norms, bits, rot.dim)).astype(dtype)


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------

# Nominal --kv-bits -> (key bits, value bits); see the module docstring.
BIT_SPLITS = {4: (5, 3), 3: (4, 2), 2: (2, 2)}
# Exact positions a cache keeps besides the codes: the first `DEFAULT_SINK_TOKENS` (the
# attention sink most trained models lean on) and, for each query, its `DEFAULT_WINDOW`
# most recent positions (trained models put much of their attention there; the largest
# single quality gain, bench/RESULTS.md#turboquant-bit-split).
DEFAULT_SINK_TOKENS = 4
DEFAULT_WINDOW = 8
# Trims of up to this many tokens keep the window exact (exact copies of the last
# window - 1 + reserve tokens, each a token in the model's dtype per layer and head). A
# cache made outside the engine keeps none: plain decoding never trims, and after a
# trim past the reserve attention stays right but reads codes where copies were gone
# (not token-equal to plain decoding). The engine passes what its verify passes roll
# back, (L + 1) or, pipelined, 2 * (L + 1) (Engine.make_cache). At a few hundred tokens
# five copies were what put a 4-bit cache above mlx-lm's 4-bit cache in bytes
# (bench/RESULTS.md#turboquant-quality-on-models-it-was-not-tuned-on).
DEFAULT_TRIM_RESERVE = 0


def resolve_bits(bits: int) -> Tuple[int, int]:
    """Nominal --kv-bits -> (key bits, value bits)."""
    if bits not in BIT_SPLITS:
        raise ValueError(f"kv bits must be one of {tuple(BIT_SPLITS)}, got {bits!r}")
    return BIT_SPLITS[bits]

