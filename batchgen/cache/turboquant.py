"""TurboQuant KV cache: random rotation + Lloyd-Max scalar codes, for mlx-lm models.

Codec (Zandieh et al. 2025, "TurboQuant", the MSE variant): each key or value vector x
(one head, one token) is stored as
    codes   b-bit index per coordinate of  sqrt(d) * R x / ||x||  into the Lloyd-Max
            codebook of N(0, 1), packed into uint32 words (3 and 5 bits straddle words)
    scale   one float16: ||x|| * sqrt(d) / ||codebook values||, so the reconstruction
            is exactly as long as x (removes the MSE quantizer's shrinkage of |q.k|)
R is a seeded random orthogonal map: random signs then the normalised Walsh-Hadamard
transform for power-of-two head dims, a dense random orthogonal matrix otherwise. After
R every coordinate of a unit vector has the same law (Beta, ~N(0, 1/d)) whatever x is:
outlier channels are spread over all coordinates and one data-free codebook serves all
vectors, with no per-group scales or zero points.

Cache (`TurboQuantKVCache`, mlx-lm's cache protocol), and why it beats a plain
"K and V at 4 bits from the first token" (which lost to mlx-lm's affine 4-bit cache):
  * keys get more bits than values (bits=4: K 5 / V 3). A key error moves a softmax
    logit and is scaled by |q|; a value error is averaged over the attended tokens.
  * the last `window` (8) tokens are read uncompressed by each query, and the first
    `sink_tokens` (4) tokens are kept uncompressed. Trained models put much of their
    attention on the few most recent tokens, and LLMs on the first one (the attention
    sink). The window is the largest single gain on the trained model (KL / 3.5 to
    / 5); the sinks matter most on the synthetic data (attention output error / 2).
  * every token is encoded once, on arrival, from its own vector only, so codes never
    depend on chunking. The exact copies of the last `window - 1 + trim_reserve`
    tokens make trims of up to `trim_reserve` (5, the engine's default draft length)
    tokens exact too.
  Tried and not kept: the QJL residual bit (TurboQuant_prod; unbiased scores but more
  variance: twice the attention error of the same bits spent on the MSE codes), the
  exact Beta codebook of dimension d (no gain), subtracting a per-head key mean (mixed).

Attention. `update_and_fetch` returns the keys/values dequantized to the model dtype,
with the new chunk and the `window - 1` tokens before it exact, so any model's
attention works unchanged. `make_turboquant_cache` also calls `install_attention`: the
layers' attention then calls `TurboQuantKVCache.attention`, which rotates the L_q
queries instead of un-rotating all L keys and values, applies the stored scales to the
L_q x L scores and probabilities instead of to the L x d keys and values (q.k_j =
scale_j / sqrt(d) * q.c_j), and reads each query's own window exactly -- the same
result for any chunking (prefill chunks, prompt-cache reuse, prompt-lookup verify).
The dequantized fetch is then never computed (MLX is lazy). What the cache holds is
codes, scales, sinks and the recent copies; the per-step codebook lookup of the history
is transient, one layer at a time.

Step mode (CUDA): a one-token decode step on that path is dozens of small ops per layer,
which bound a GPU step at any context length (0.01-0.03x of fp16 attention on an H200).
There, update_and_fetch only hands the token over and `attention` runs one kernel and a
merge (`turboquant_kernels.step`): it encodes the token into a window of recent slots
(exact copies and codes; into the big buffers every STEP_BLOCK steps) and attends over
sinks + codes + the query's exact window in blocks over the positions -- the same
reading rule, so the ops path stays the reference (tests/test_turboquant_step.py).

Bits (`--kv-bits` is the nominal bits per coordinate, averaged over K and V):
    bits=4: K 5, V 3    bits=3: K 4, V 2    bits=2: K 2, V 2
Bytes per token per kv head and layer: (kb + vb) * d / 8 for codes + 4 for the two
scales, against 4 * d for fp16 (0.266x at d=64, 0.258x at d=128, bits=4), plus
(sink_tokens + window - 1 + trim_reserve) = 16 exact tokens. nbytes (the allocated
bytes, capacity in 256-token steps like mlx-lm's KVCache) is <= 0.30x of an fp16
KVCache's from 512 tokens on for head_dim 64 and 128 at bits=4; below that the 16
exact tokens dominate. mlx-lm's affine 4-bit cache holds 9 bits per coordinate pair
(0.281x); this cache holds fewer bytes than it from ~700 tokens (d=128) or ~1000
tokens (d=64) on.

Evidence: bench/turboquant_quality.py (KL of next-token distributions against an fp32
cache, teacher-forced decode of 64 tokens after a 256-token prefill; lower is better;
"trained" is a 4-layer llama trained on Python source, the others random-weight tiny
models, "+kbias" with key outlier channels):
                              x fp16   trained  +kbias  llama  qwen3  qwen3_moe  synth
                              d=128/64   KL      KL      KL     KL      KL      err/TV
    mlx affine 4b g64       0.281/.281  .0100   .252   .0281  .0093   .0369   .23/.087
    tq K4/V4 (plain)        0.258/.266  .0137   .136   .0274  .0082   .0550   .18/.061
    tq K4/V4 +sink4         0.261/.268  .0149   .134   .0263  .0080   .0512   .08/.029
    tq K5/V3 +sink4         0.261/.268  .0126   .088   .0521  .0215   .0667   .09/.016
    tq K4/V4 +sink4 +win8   0.272/.280  .0043   .133   .0258  .0076   .0428   .08/.029
    tq K5/V3 +sink4 +win8   0.272/.280  .0026   .086   .0505  .0206   .0641   .09/.016
     = TurboQuantKVCache(4)             .0024   .086   .0509  .0255   .0661
    tq K4(3+QJL)/V4         0.262/.273    -       -      -      -       -     .32/.126
    mlx affine 3b g64       0.219/.219  .0719   .622   .1149  .0349   .1222   .47/.177
    tq K3/V3 +sink4 +win8   0.210/.218  .0167   .329   .0953  .0305   .0894   .15/.057
    tq K4/V2 +sink4 +win8   0.210/.218  .0189   .264   .1798  .0740   .1787   .17/.029
     = TurboQuantKVCache(3)             .0126   .289   .1506  .0743   .1630
    mlx affine 2b g64       0.156/.156  .340    .957   .415   .151    .277    .74/.299
     = TurboQuantKVCache(2) 0.148/.156  .0430   .699   .263   .112    .220

  (2 sequences per model: differences under ~25% are noise. On the trained model with
  8 sequences: K5/V3 .0027 vs K4/V4 .0050 (+sink4 +win8); K4/V2 .0126 vs K3/V3 .0126.
  qwen3_5's two attention layers barely move its logits (all KL < .005). synth: relative
  error of the attention output / softmax total variation, d=128.)

  Reading: on the trained model the minimal codec (K4/V4) is worse than affine 4-bit,
  as observed before; the recent window is the largest gain there (/3.5 to /5), keys
  at 5 bits and values at 3 the next (/1.6 to /1.9); with both, 4x lower KL than
  affine 4-bit, in fewer bytes from ~700 tokens on (d=128). With key outlier channels
  (+kbias) the affine cache breaks down (each group's range is stretched by the
  outlier) and the rotated one does not; more key bits help again. Random-weight
  models (no trained attention pattern, value errors amplified by random projections)
  prefer K4/V4; they are the weakest proxy, so the defaults follow the trained model,
  the outlier case and the synthetic scores. bits=3 is a tie on the trained model and
  follows the same rule.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from ..kernels import turboquant as _kernels

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

# Nominal --kv-bits -> (key bits, value bits). See the module docstring for why.
BIT_SPLITS = {4: (5, 3), 3: (4, 2), 2: (2, 2)}
DEFAULT_SINK_TOKENS = 4
DEFAULT_WINDOW = 8
# The engine's default prompt-lookup draft length (config.DEFAULT_PLD_MAX_LOOKUP).
DEFAULT_TRIM_RESERVE = 5


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


def encode(x: mx.array, bits: int, rot: Rotation) -> Tuple[mx.array, mx.array]:
    """`quantize`; on CUDA the kernel that step mode encodes with, so that a token's
    codes are the same whichever path stored it."""
    if STEP_KERNEL and rot.hadamard and _kernels.available() and _kernels.encode_supported(rot.dim):
        levels, edges = codebook_arrays(bits)
        return _kernels.encode(x, rot.signs, levels, edges, bits)
    return quantize(x, bits, rot)


def dequantize_rotated(
    words: mx.array, norms: mx.array, bits: int, dim: int
) -> mx.array:
    """Codes -> float32 vectors in the rotated domain (R x)."""
    c = _levels(words, bits, dim)
    return c * (norms.astype(mx.float32)[..., None] * (1.0 / math.sqrt(dim)))


def dequantize(
    words: mx.array, norms: mx.array, bits: int, rot: Rotation, dtype=mx.float32
) -> mx.array:
    """Codes -> vectors (..., d) in `dtype`."""
    return rot.inverse(dequantize_rotated(words, norms, bits, rot.dim)).astype(dtype)


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def resolve_bits(bits: int) -> Tuple[int, int]:
    """Nominal --kv-bits -> (key bits, value bits)."""
    if bits not in BIT_SPLITS:
        raise ValueError(f"kv bits must be one of {tuple(BIT_SPLITS)}, got {bits!r}")
    return BIT_SPLITS[bits]


def _detach(x: Optional[mx.array]) -> Optional[mx.array]:
    """A slice that owns its memory: a plain slice is a view that would keep the whole
    source buffer (e.g. a 2048-token prefill chunk) alive."""
    return None if x is None else mx.contiguous(x)


class TurboQuantKVCache(_BaseCache):
    """KV cache holding TurboQuant codes (see the module docstring).

    Args:
        bits: nominal bits per coordinate (`BIT_SPLITS` maps it to key/value bits).
        key_bits, value_bits: override the split (any of `SUPPORTED_BITS`).
        sink_tokens: leading tokens kept uncompressed (model dtype).
        window: each query reads its `window` most recent tokens (itself included)
            uncompressed; the cache keeps exact copies of the last
            `window - 1 + trim_reserve` tokens for that.
        trim_reserve: trims up to this many tokens keep the window exact (prompt-lookup
            decoding rejects at most its draft length); larger trims still work, the
            window then reads codes for the tokens whose copies are gone.
        seed: rotation seed; `make_turboquant_cache` gives each layer its own.
    """

    step = 256

    def __init__(
        self,
        bits: int = 4,
        *,
        key_bits: Optional[int] = None,
        value_bits: Optional[int] = None,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        window: int = DEFAULT_WINDOW,
        trim_reserve: int = DEFAULT_TRIM_RESERVE,
        seed: int = 0,
    ):
        default_k, default_v = resolve_bits(bits)
        # Not `bits`: mlx-lm's attention treats any cache with a `bits` attribute as
        # its own affine-quantized cache.
        self.nominal_bits = bits
        self.key_bits = key_bits or default_k
        self.value_bits = value_bits or default_v
        for name, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if b not in CODEBOOKS:
                raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {b!r}")
        for name, n in (
            ("sink_tokens", sink_tokens),
            ("window", window),
            ("trim_reserve", trim_reserve),
        ):
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        self.sink_tokens = sink_tokens
        self.window = window
        self.trim_reserve = trim_reserve
        self.seed = int(seed)
        self.offset = 0
        self.dtype_name = ""
        self.key_dim = 0
        self.value_dim = 0
        # Uncompressed leading tokens (B, H, <= sink_tokens, d), model dtype.
        self.sink_keys = None
        self.sink_values = None
        # Codes of every token from position sink_tokens on, (B, H, capacity, words)
        # uint32, and their scales (B, H, capacity) float16; capacity grows in steps.
        self.key_codes = None
        self.key_norms = None
        self.value_codes = None
        self.value_norms = None
        # Exact copies of the most recent tokens (positions offset - n .. offset - 1).
        self.recent_keys = None
        self.recent_values = None
        # Whether the model's attention calls `attention` (install_attention done):
        # update_and_fetch then hands the exact chunk to that call, which drops it.
        # Cleared by itself after one step if no call comes.
        self.routed = _attention_installed()
        self._chunk = None
        # Step mode (CUDA decode, see `_step_attention`): the token handed over by
        # update_and_fetch, the window's arrays (wx exact keys and values, wc key and
        # value codes, wq their scales; slots on axis 2) and its positions: slot 0
        # holds position _win_r0, _win_n slots are in use, codes below position
        # _win_cb are in the big buffers, above it in the window.
        self._step_new = None
        self._win = None
        self._win_r0 = self._win_n = self._win_cb = 0

    # -- helpers ---------------------------------------------------------------------

    @property
    def _n_sink(self) -> int:
        return min(self.offset, self.sink_tokens)

    @property
    def _n_coded(self) -> int:
        return max(0, self.offset - self.sink_tokens)

    @property
    def _n_recent(self) -> int:
        return 0 if self.recent_keys is None else self.recent_keys.shape[2]

    @property
    def _recent_capacity(self) -> int:
        # A window of 1 (the query's own token) is always in the chunk at hand.
        return 0 if self.window <= 1 else self.window - 1 + self.trim_reserve

    @property
    def dtype(self):
        return getattr(mx, self.dtype_name) if self.dtype_name else mx.float16

    def _rotation(self, dim: int) -> Rotation:
        return rotation(dim, self.seed)

    def _check(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                "TurboQuantKVCache expects keys/values of shape (B, n_kv_heads, L, "
                f"head_dim), got {keys.shape} and {values.shape}"
            )
        if self.key_dim and (
            keys.shape[-1] != self.key_dim or values.shape[-1] != self.value_dim
        ):
            raise ValueError(
                f"head dims changed: cache has {self.key_dim}/{self.value_dim}, got "
                f"{keys.shape[-1]}/{values.shape[-1]}"
            )

    def _grow(self, B: int, H: int, used: int, needed: int):
        """Room for `needed` coded tokens, keeping the first `used` (amortised growth
        in steps of `step` tokens, like mlx-lm's KVCache)."""
        have = 0 if self.key_codes is None else self.key_codes.shape[2]
        if needed <= have:
            return
        keep = min(used, have)
        new_cap = -(-needed // self.step) * self.step

        def grow(buf, tail_shape, dtype):
            fresh = mx.zeros((B, H, new_cap - keep, *tail_shape), dtype)
            if buf is None or keep == 0:
                return fresh
            return mx.concatenate([buf[:, :, :keep], fresh], axis=2)

        kw = packed_words(self.key_dim, self.key_bits)
        vw = packed_words(self.value_dim, self.value_bits)
        self.key_codes = grow(self.key_codes, (kw,), mx.uint32)
        self.value_codes = grow(self.value_codes, (vw,), mx.uint32)
        self.key_norms = grow(self.key_norms, (), mx.float16)
        self.value_norms = grow(self.value_norms, (), mx.float16)

    def _append_sinks(self, keys, values, prev: int, n: int):
        sk, sv = keys[:, :, :n], values[:, :, :n]
        if prev > 0 and self.sink_keys is not None:
            sk = mx.concatenate([self.sink_keys[:, :, :prev], sk], axis=2)
            sv = mx.concatenate([self.sink_values[:, :, :prev], sv], axis=2)
        self.sink_keys, self.sink_values = _detach(sk), _detach(sv)

    def _append_codes(self, keys, values, start: int):
        B, H, L, _ = keys.shape
        self._grow(B, H, start, start + L)
        kc, kn = encode(keys, self.key_bits, self._rotation(self.key_dim))
        vc, vn = encode(values, self.value_bits, self._rotation(self.value_dim))
        stop = start + L
        self.key_codes[:, :, start:stop] = kc
        self.key_norms[:, :, start:stop] = kn
        self.value_codes[:, :, start:stop] = vc
        self.value_norms[:, :, start:stop] = vn

    def _exact_tail(self, keys, values):
        """Exact K/V of the new chunk plus the window - 1 tokens before it."""
        w0 = min(self.window - 1, self._n_recent)
        if w0 <= 0:
            return keys, values
        rk = self.recent_keys[:, :, self._n_recent - w0 :]
        rv = self.recent_values[:, :, self._n_recent - w0 :]
        return mx.concatenate([rk, keys], 2), mx.concatenate([rv, values], 2)

    def _keep_recent(self, keys, values):
        """Keep exact copies of the last window - 1 + trim_reserve tokens."""
        cap, L, n_old = self._recent_capacity, keys.shape[2], self._n_recent
        if cap == 0:
            return
        if L < cap and n_old:
            lo = max(0, n_old - (cap - L))
            keys = mx.concatenate([self.recent_keys[:, :, lo:], keys], axis=2)
            values = mx.concatenate([self.recent_values[:, :, lo:], values], axis=2)
        self.recent_keys = _detach(keys[:, :, -cap:])
        self.recent_values = _detach(values[:, :, -cap:])

    # -- protocol --------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store the chunk; return all keys/values, dequantized to the model dtype.

        The chunk's own tokens and the window - 1 before it come back exact (for one
        token at a time that is exactly "the last `window` tokens exact").
        """
        self._check(keys, values)
        if not self.dtype_name:
            self.dtype_name = str(keys.dtype).split(".")[-1]
            self.key_dim, self.value_dim = keys.shape[-1], values.shape[-1]
        if self._chunk is not None or self._step_new is not None:
            # The last chunk was never read by `attention`: this model's attention
            # does not go through the hook, so stop handing chunks over.
            self.routed = False
            self._absorb_step()
        if keys.shape[2] == 1 and self._steps():
            # Step mode: `attention` stores the token (one kernel); nothing here.
            self._step_new = (keys, values)
            self.offset += 1
            return keys, values
        self._leave_step()
        return self._update(keys, values)

    def _update(self, keys: mx.array, values: mx.array):
        prev, L = self.offset, keys.shape[2]
        n_sink = max(0, min(self.sink_tokens, prev + L) - prev)
        if n_sink:
            self._append_sinks(keys, values, prev, n_sink)
        if L > n_sink:
            start = max(0, prev - self.sink_tokens)
            self._append_codes(keys[:, :, n_sink:], values[:, :, n_sink:], start)
        tail = None
        if self.window:
            tail = self._exact_tail(keys, values)
            self._keep_recent(keys, values)
        self.offset += L
        self._chunk = tail if (self.routed and tail is not None) else None
        return self._fetch(tail)

    def _fetch(self, tail):
        keys, values = self.keys_and_values()
        if tail is None:
            return keys, values
        n = min(tail[0].shape[2], self.offset)
        if n == self.offset:
            return tail
        cut = self.offset - n
        return (
            mx.concatenate([keys[:, :, :cut], tail[0][:, :, -n:]], 2),
            mx.concatenate([values[:, :, :cut], tail[1][:, :, -n:]], 2),
        )

    def _coded(self):
        n = self._n_coded
        return (
            self.key_codes[:, :, :n],
            self.key_norms[:, :, :n],
            self.value_codes[:, :, :n],
            self.value_norms[:, :, :n],
        )

    def keys_and_values(self, rotated: bool = False):
        """All `offset` keys and values as stored: exact sinks, then decoded codes.

        Model dtype; `rotated=True` gives float32 in the rotated domain (R k, R v) for
        attention that rotates the query instead.
        """
        self._settle()
        s = self._n_sink
        parts_k, parts_v = [], []
        if s:
            sk, sv = self.sink_keys[:, :, :s], self.sink_values[:, :, :s]
            if rotated:
                sk = self._rotation(self.key_dim).forward(sk.astype(mx.float32))
                sv = self._rotation(self.value_dim).forward(sv.astype(mx.float32))
            parts_k.append(sk)
            parts_v.append(sv)
        if self._n_coded:
            kc, kn, vc, vn = self._coded()
            k = dequantize_rotated(kc, kn, self.key_bits, self.key_dim)
            v = dequantize_rotated(vc, vn, self.value_bits, self.value_dim)
            if not rotated:
                k = self._rotation(self.key_dim).inverse(k).astype(self.dtype)
                v = self._rotation(self.value_dim).inverse(v).astype(self.dtype)
            parts_k.append(k)
            parts_v.append(v)
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self._settle()
        n = min(self.offset, n)
        self.offset -= n
        self._chunk = None
        # Codes past the new offset stay allocated and are overwritten by the next
        # update; sinks are cut on their next append.
        keep = self._n_recent - n
        if keep <= 0:
            self.recent_keys = self.recent_values = None
        elif n:
            self.recent_keys = self.recent_keys[:, :, :keep]
            self.recent_values = self.recent_values[:, :, :keep]
        return n

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None
    ):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @property
    def nbytes(self) -> int:
        """Bytes held: sinks, codes and norms (allocated capacity), recent copies
        (in step mode the window's slots, exact and coded)."""
        arrays = (
            self.sink_keys,
            self.sink_values,
            self.key_codes,
            self.key_norms,
            self.value_codes,
            self.value_norms,
            self.recent_keys,
            self.recent_values,
            *(self._win or ()),
        )
        return sum(a.nbytes for a in arrays if a is not None)

    # -- state (mlx-lm's save_prompt_cache / load_prompt_cache) -----------------------

    _META = (
        "offset",
        "nominal_bits",
        "key_bits",
        "value_bits",
        "sink_tokens",
        "window",
        "trim_reserve",
        "seed",
        "key_dim",
        "value_dim",
    )

    @property
    def meta_state(self) -> Tuple[str, ...]:
        return tuple(str(getattr(self, k)) for k in self._META) + (self.dtype_name,)

    @meta_state.setter
    def meta_state(self, v):
        *ints, dtype_name = v
        if len(ints) != len(self._META):
            raise ValueError(
                f"TurboQuantKVCache meta_state needs {len(self._META) + 1} items"
            )
        for k, x in zip(self._META, ints):
            setattr(self, k, int(x))
        self.dtype_name = str(dtype_name)
        self.routed = _attention_installed()
        self._chunk = None
        self._step_new = self._win = None

    @property
    def state(self):
        """Arrays cut to what is in use, then the meta state (strings).

        mlx-lm 0.32's save_prompt_cache stores `state` alone (strings included) and
        load_prompt_cache rebuilds with `from_state(state)`.
        """
        self._settle()
        s = self._n_sink
        sink_k = None if self.sink_keys is None else self.sink_keys[:, :, :s]
        sink_v = None if self.sink_values is None else self.sink_values[:, :, :s]
        coded = (None,) * 4 if self.key_codes is None else self._coded()
        recent = (self.recent_keys, self.recent_values)
        return (sink_k, sink_v, *coded, *recent, *self.meta_state)

    @state.setter
    def state(self, v):
        sink_k, sink_v, kc, kn, vc, vn, rk, rv, *meta = v
        self.meta_state = meta
        self.sink_keys, self.sink_values = sink_k, sink_v
        self.key_codes, self.key_norms = kc, kn
        self.value_codes, self.value_norms = vc, vn
        self.recent_keys, self.recent_values = rk, rv

    # -- rows of one prompt pass (`entering`) -----------------------------------------

    def repeated(self, rows: int, reserve: int) -> "TurboQuantKVCache":
        """This one-row cache's tokens in `rows` rows, for one pass over several
        prompts' tails after them, each right-padded: it keeps `reserve` more
        exact recent copies, so that cutting up to that many pads off a row
        (`row`) leaves what a pass of the row's own would (codes never depend on
        chunking; the copies are what a trim would lose)."""
        out = self._mapped(lambda a: mx.repeat(a, rows, axis=0))
        out.trim_reserve += reserve
        return out

    def row(self, r: int, length: int, reserve: int) -> "TurboQuantKVCache":
        """Row r of a `repeated` cache (`reserve` as given there) after its pass,
        cut to its first `length` tokens, as a one-row cache (copied: it must not
        keep the pass's arrays alive)."""
        out = self._mapped(lambda a: mx.contiguous(a[r : r + 1]))
        out.trim(self.offset - length)
        out.trim_reserve -= reserve
        extra = out._n_recent - out._recent_capacity  # copies beyond what a pass of its own keeps
        if extra > 0:
            out.recent_keys, out.recent_values = out.recent_keys[:, :, extra:], out.recent_values[:, :, extra:]
        if not out._n_coded:  # all of it in the sinks: no codes, as a pass of its own leaves it
            out.key_codes = out.key_norms = out.value_codes = out.value_norms = None
        return out

    def _mapped(self, fn) -> "TurboQuantKVCache":
        """A cache of this one's meta state holding fn(a) for each of its arrays."""
        out, state = TurboQuantKVCache(self.nominal_bits), self.state
        out.state = [None if a is None else fn(a) for a in state[:8]] + list(state[8:])
        return out

    # -- attention in the rotated domain ----------------------------------------------

    def attention(
        self,
        queries: mx.array,
        scale: float,
        mask=None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """softmax(q K^T * scale) V over everything cached, straight from the codes.

        (R q).(R k) == q.k for orthogonal R, and sum_j p_j R v_j == R (sum_j p_j v_j):
        the L_q queries and outputs are rotated instead of all `offset` keys and
        values. A coded key is norm_j / sqrt(d) * c_j (c_j the codebook values), so
        q.k_j = norm_j / sqrt(d) * (q.c_j): the norms scale the L_q x L scores and the
        probabilities, not the L x d keys and values. Query i reads keys
        i - window < j <= i exactly (the chunk handed over by update_and_fetch, or the
        recent copies) and sinks exactly -- the same for any chunking of the sequence.
        """
        if sinks is not None:
            raise ValueError("TurboQuantKVCache attention does not take `sinks`")
        if queries.shape[2] == 1 and _FLASH_MASK[0] is not None:
            _FLASH_MASK[:] = [None, None]  # the prefill's mask (L_q x context) is done with
        if self._step_new is not None:
            if self._step_fits(queries, mask):
                return self._step_attention(queries, scale)
            self._absorb_step()
        dtype = queries.dtype
        q = self._rotation(self.key_dim).forward(queries.astype(mx.float32))
        tail, self._chunk = self._chunk, None
        if tail is None and self.window and self._n_recent:
            tail = (self.recent_keys, self.recent_values)
        parts = self._rotated_parts(tail, dtype)
        if self._flash(queries, mask):
            out = _flash_attention(q.astype(dtype), parts, self.offset, self.window, scale)
        else:
            out = self._blocked_attention((q * scale).astype(dtype), parts, mask)
        out = self._rotation(self.value_dim).inverse(out.astype(mx.float32))
        return out.astype(dtype)

    def _flash(self, queries: mx.array, mask) -> bool:
        """Whether a multi-query pass takes `_flash_attention` (FLASH_ATTENTION)."""
        if FLASH_ATTENTION is False or queries.shape[2] == 1 or isinstance(mask, mx.array):
            return False
        if FLASH_ATTENTION is None:  # where mx.fast takes it to cuDNN's fused attention
            dims_ok = all(d % 8 == 0 and d <= 128 for d in (self.key_dim, self.value_dim))
            # Short passes (prompt-lookup verify) stay blocked: cuDNN builds a plan per
            # (queries, keys) shape, and a verify pass's shape changes every round.
            long_pass = queries.shape[2] >= FLASH_MIN_QUERIES
            return long_pass and dims_ok and queries.dtype in (mx.float16, mx.bfloat16) and _kernels.available()
        return True

    def _blocked_attention(self, q: mx.array, parts, mask) -> mx.array:
        """`_rotated_attention` over blocks of queries (q scaled and rotated)."""
        L_q = q.shape[2]
        outs = []
        # Blocks of queries bound the (L_q x offset) scores of long prefill chunks.
        block = query_block(q.shape[1], self.offset)
        for lo in range(0, L_q, block):
            hi = min(L_q, lo + block)
            m = mask[..., lo:hi, :] if isinstance(mask, mx.array) else mask
            end = self.offset - (L_q - hi)
            outs.append(_rotated_attention(q[:, :, lo:hi], parts, end, self.window, m))
            if block < L_q:
                # One block at a time: left lazy, MLX runs the blocks' graphs side by
                # side and holds all their scores at once (CPU: ~2x one layer's peak).
                # On the H200, blocks merely ordered (mx.depends) still peaked at
                # 15.6 GB prefilling 8k tokens into a 0.5B model, against 2.9 GB for
                # mlx-lm's cache.
                mx.eval(outs[-1])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _rotated_parts(self, tail, dtype):
        """Sinks, codebook values with per-token scales, exact tail; rotated domain."""
        rot_k = self._rotation(self.key_dim)
        rot_v = self._rotation(self.value_dim)

        def rotate(x, rot):
            return rot.forward(x.astype(mx.float32)).astype(dtype)

        s = self._n_sink
        sinks = None
        if s:
            sinks = (
                rotate(self.sink_keys[:, :, :s], rot_k),
                rotate(self.sink_values[:, :, :s], rot_v),
            )
        coded = CodedHistory(self, dtype) if self._n_coded else None
        if tail is not None:
            n = min(tail[0].shape[2], self.offset)
            tail = (
                rotate(tail[0][:, :, -n:], rot_k),
                rotate(tail[1][:, :, -n:], rot_v),
            )
        return sinks, coded, tail

    # -- step mode: a one-token decode step as one kernel (CUDA) -----------------------
    #
    # A decode step on the ops path is dozens of small ops per layer, and a GPU step of
    # a small model is bound by their count, not by bytes. In step mode update_and_fetch
    # only hands the token over; `attention` runs `turboquant_kernels.step`, which
    # encodes it into the window's next slot and attends over sinks + codes + window.
    # Every STEP_BLOCK steps the window's codes go into the big buffers (a few ops).
    # Anything else (a multi-token update, trim, state, a mask) first settles the cache
    # back into the ordinary layout, so the rest of the class never sees a window.

    STEP_BLOCK = 32

    def _steps(self) -> bool:
        """Whether a one-token update takes step mode."""
        return (
            STEP_KERNEL
            and self.routed
            and self.window >= 1
            and self.offset >= self.sink_tokens
            and self.key_dim == self.value_dim
            and _kernels.available()
            and _kernels.step_supported(self.key_dim, 1, self.key_bits, self.value_bits)
        )

    def _step_fits(self, queries: mx.array, mask) -> bool:
        _, n_heads, L, dim = queries.shape
        kv_heads = self._step_new[0].shape[1]
        return (
            L == 1
            and not isinstance(mask, mx.array)
            and n_heads % kv_heads == 0
            and _kernels.step_supported(dim, n_heads // kv_heads, self.key_bits, self.value_bits)
        )

    def _absorb_step(self):
        """The token handed to step mode goes the ordinary way instead."""
        if self._step_new is None:
            return
        keys, values = self._step_new
        self._step_new = None
        self.offset -= 1
        self._leave_step()
        self._chunk = None
        self._update(keys, values)

    def _settle(self):
        """Back to the ordinary layout: every token coded in the big buffers, the
        recent exact copies in recent_keys / recent_values."""
        self._absorb_step()
        self._leave_step()

    def _enter_step(self, B: int, H: int, dtype):
        p = self.offset - 1  # the handed-over token's position
        n, slots, dim = self._n_recent, self._recent_capacity + self.STEP_BLOCK, self.key_dim

        exact = mx.zeros((B, H, slots, 2, dim), dtype)
        if n:
            recent = mx.stack([self.recent_keys[:, :, -n:], self.recent_values[:, :, -n:]], axis=3)
            exact = mx.concatenate([recent.astype(dtype), exact[:, :, n:]], axis=2)
        words = packed_words(dim, self.key_bits) + packed_words(dim, self.value_bits)
        self._win = (exact, mx.zeros((B, H, slots, words), mx.uint32), mx.zeros((B, H, slots, 2), mx.float16))
        self._win_r0, self._win_n, self._win_cb = p - n, n, p
        self.recent_keys = self.recent_values = None
        if self.key_codes is None:
            self._grow(B, H, 0, 1)
        # The kernel indexes these as dense arrays (a loaded or cloned state may hold
        # views); flushes and sink appends keep them dense from here on.
        for name in ("key_codes", "key_norms", "value_codes", "value_norms", "sink_keys", "sink_values"):
            if getattr(self, name) is not None:
                setattr(self, name, mx.contiguous(getattr(self, name)))

    def _flush_window(self):
        """The window's codes for positions cb .. r0 + n - 1 into the big buffers."""
        _, wc, wq = self._win
        r0, n, cb = self._win_r0, self._win_n, self._win_cb
        lo = cb - r0
        if n > lo:
            t0 = cb - self.sink_tokens
            t1 = t0 + n - lo
            kw = self.key_codes.shape[-1]
            self._grow(wc.shape[0], wc.shape[1], t0, t1)
            self.key_codes[:, :, t0:t1] = wc[:, :, lo:n, :kw]
            self.value_codes[:, :, t0:t1] = wc[:, :, lo:n, kw:]
            self.key_norms[:, :, t0:t1] = wq[:, :, lo:n, 0]
            self.value_norms[:, :, t0:t1] = wq[:, :, lo:n, 1]
        self._win_cb = r0 + n

    def _kept_slots(self) -> Optional[mx.array]:
        """The window's exact keys and values worth keeping (the last
        `_recent_capacity` slots in use), (B, H, n, 2, D); None if none."""
        n = self._win_n
        keep = min(n, self._recent_capacity)
        return self._win[0][:, :, n - keep : n] if keep else None

    def _shift_window(self):
        """Room for the next token: flush, then move the kept slots to the front."""
        self._flush_window()
        wx, *coded = self._win
        kept = self._kept_slots()
        keep = 0 if kept is None else kept.shape[2]
        fresh = mx.zeros((*wx.shape[:2], wx.shape[2] - keep, *wx.shape[3:]), wx.dtype)
        self._win = (fresh if kept is None else mx.concatenate([kept, fresh], axis=2), *coded)
        self._win_r0 += self._win_n - keep
        self._win_n = keep

    def _leave_step(self):
        if self._win is None:
            return
        self._flush_window()
        kept = self._kept_slots()
        self.recent_keys = None if kept is None else _detach(kept[..., 0, :])
        self.recent_values = None if kept is None else _detach(kept[..., 1, :])
        self._win = None

    def _step_attention(self, queries: mx.array, scale: float) -> mx.array:
        keys, values = self._step_new
        self._step_new = None
        B, H = keys.shape[:2]
        if self._win is None:
            self._enter_step(B, H, keys.dtype)
        p = self.offset - 1
        if p - self._win_r0 >= self._win[0].shape[2]:
            self._shift_window()
        r0, S = self._win_r0, self.sink_tokens
        chunks, span = _kernels.step_chunks(p + 1, B * H, self.key_dim)
        if S:
            sinks = (self.sink_keys, self.sink_values)
        else:
            sinks = (_kernels.constant(("nosink", B, H, self.key_dim, keys.dtype),
                                    lambda: mx.zeros((B, H, 1, self.key_dim), keys.dtype)),) * 2  # fmt: skip
        e0 = max(S, p - self.window + 1, r0)
        fields = (p, S, self.key_codes.shape[2], self._win_cb, r0, chunks, e0, self._win[0].shape[2],
                  sinks[0].shape[2], span)  # fmt: skip
        meta = _kernels.step_meta(fields)
        coded = (self.key_codes, self.key_norms, self.value_codes, self.value_norms)
        books = _step_books(self.key_dim, self.seed, self.key_bits, self.value_bits, scale)
        out, self._win = _kernels.step(queries, (keys, values), sinks, coded, self._win, books, meta, chunks,
                                       (self.key_bits, self.value_bits))  # fmt: skip
        self._win_n = p - r0 + 1
        return out


# One-token decode steps through `turboquant_kernels.step` where it applies (CUDA);
# False keeps every step on the ops path (benchmarks compare the two).
STEP_KERNEL = True


@lru_cache(maxsize=None)
def _step_books(dim: int, seed: int, key_bits: int, value_bits: int, scale: float) -> mx.array:
    """`turboquant_kernels.step_books` of a layer (keys and values share its rotation)."""
    books = _kernels.step_books(rotation(dim, seed).signs, *codebook_arrays(key_bits),
                                *codebook_arrays(value_bits), scale)  # fmt: skip
    mx.eval(books)
    return books


# Use the fused CUDA kernels (turboquant_kernels) where they apply; False keeps the
# plain-ops path everywhere (benchmarks compare the two).
FUSED_KERNELS = True


class CodedHistory:
    """One layer's coded tokens (positions sink_tokens .. offset - 1) as attention
    reads them, in the rotated domain: scores of queries against the keys, and
    probability-weighted sums of the values. A coded vector is scale / sqrt(d) times
    its codebook values, so the scales multiply the L_q x L scores and probabilities,
    never an L x d array."""

    def __init__(self, cache: "TurboQuantKVCache", dtype):
        self.cache, self.dtype, self.n = cache, dtype, cache._n_coded
        self.n_kv_heads = cache.key_codes.shape[1]
        self._decoded = {}  # ops path: codebook values, once per call (not per query block)

    def decoded(self) -> Tuple[mx.array, mx.array]:
        """Keys and values as vectors in the rotated domain, model dtype."""
        c, n = self.cache, self.n
        k = dequantize_rotated(c.key_codes[:, :, :n], c.key_norms[:, :, :n], c.key_bits, c.key_dim)
        v = dequantize_rotated(c.value_codes[:, :, :n], c.value_norms[:, :, :n], c.value_bits, c.value_dim)
        return k.astype(self.dtype), v.astype(self.dtype)

    def _values_of(self, which: str) -> mx.array:
        """Codebook values (model dtype, not yet scaled) of the keys ("k") or values ("v")."""
        if which not in self._decoded:
            c = self.cache
            keys = which == "k"
            words = c.key_codes if keys else c.value_codes
            bits, dim = (c.key_bits, c.key_dim) if keys else (c.value_bits, c.value_dim)
            self._decoded[which] = _levels(words[:, :, : self.n], bits, dim).astype(self.dtype)
        return self._decoded[which]

    def _fused(self, rows: int, dim: int, bits: int) -> bool:
        return FUSED_KERNELS and _kernels.available() and _kernels.supported(rows, dim, bits)

    def scores(self, q: mx.array) -> mx.array:
        """q (B, Hkv, G, L_q, d), scaled and rotated -> float32 (B, Hkv, G, L_q, n)."""
        c, n = self.cache, self.n
        B, H, G, L, d = q.shape
        if self._fused(G * L, d, c.key_bits):
            codes = c.key_codes.reshape(B * H, *c.key_codes.shape[2:])
            scales = c.key_norms.reshape(B * H, -1)
            table, _ = codebook_arrays(c.key_bits)
            s = _kernels.scores(q.reshape(B * H, G * L, d).astype(mx.float32), codes, scales, table, c.key_bits, n)
            return s.reshape(B, H, G, L, n)
        k = self._values_of("k")
        s = (q @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)
        return s * (c.key_norms[:, :, :n].astype(mx.float32) * (1.0 / math.sqrt(d)))[:, :, None, None, :]

    def values(self, p: mx.array) -> mx.array:
        """p float32 (B, Hkv, G, L_q, n) -> sum_j p_j v_j (B, Hkv, G, L_q, d_v), model dtype."""
        c, n, d = self.cache, self.n, self.cache.value_dim
        B, H, G, L, _ = p.shape
        p = p * (c.value_norms[:, :, :n].astype(mx.float32) * (1.0 / math.sqrt(d)))[:, :, None, None, :]
        if self._fused(G * L, d, c.value_bits):
            codes = c.value_codes.reshape(B * H, *c.value_codes.shape[2:])
            table, _ = codebook_arrays(c.value_bits)
            o = _kernels.values(p.reshape(B * H, G * L, n), codes, table, c.value_bits, d)
            return o.reshape(B, H, G, L, d).astype(self.dtype)
        v = self._values_of("v")
        return p.astype(self.dtype) @ v[:, :, None]


def _levels(words: mx.array, bits: int, dim: int) -> mx.array:
    """Packed codes -> their codebook values (float32, not yet scaled)."""
    table, _ = codebook_arrays(bits)
    return mx.take(table, unpack_codes(words, bits, dim))


_SCORE_BYTES = 128 << 20


def query_block(n_q_heads: int, keys: int) -> int:
    """Queries attended together in a prefill chunk: their float32 scores over
    `keys` positions stay within _SCORE_BYTES, at least 16, at most 512. (A block's
    scores live in ~7-10 temporaries at once, measured on CPU; blocks of 512 peaked
    at 32 GB prefilling 32k tokens into a 0.5B model on the H200, against 3.9 GB for
    mlx-lm's cache.)"""
    return max(16, min(512, _SCORE_BYTES // (4 * n_q_heads * max(keys, 1))))


# Multi-query passes: None = prefill chunks of FLASH_MIN_QUERIES queries or more through
# mx.fast attention where it reaches cuDNN (CUDA, fp16/bf16, head dims <= 128), True =
# every multi-query pass (tests check it against the blocked path on the CPU), False =
# none.
FLASH_ATTENTION: Optional[bool] = None
FLASH_MIN_QUERIES = 64
_FLASH_MASK: list = [None, None]  # (key, mask) of the last pass: every layer shares it


def _flash_mask(L_q: int, end: int, n_sink: int, n_tail: int, window: int, width: int, dtype) -> mx.array:
    """The reading rule as an additive mask (1, 1, L_q, width) over the columns
    [sinks and codes of positions 0 .. end - 1, exact tail end - n_tail .. end - 1,
    padding]: query i reads j <= i from its exact copy when i - window < j and j is
    past the sinks, from its codes (or sink) otherwise.

    E.g. queries at 3 and 4 (L_q 2, end 5), no sinks, a tail of 3 (positions 2..4),
    window 2, width 8 -> readable (1) columns, codes 0..4 | tail 2..4:
        query 3: 1 1 0 0 0 | 1 1 0
        query 4: 1 1 1 0 0 | 0 1 1
    """
    key = (L_q, end, n_sink, n_tail, window, width, dtype)
    if _FLASH_MASK[0] == key:
        return _FLASH_MASK[1]
    q_pos = mx.arange(end - L_q, end)[:, None]
    k_pos = mx.arange(end)[None]
    t_pos = mx.arange(end - n_tail, end)[None]

    def exact(j):
        return (q_pos - j < window) & (q_pos >= j) & (j >= n_sink)

    stored = (q_pos >= k_pos) & ~(exact(k_pos) & (k_pos >= end - n_tail))
    padding = mx.zeros((L_q, width - end - n_tail), mx.bool_)
    readable = mx.concatenate([stored, exact(t_pos), padding], axis=1)
    bias = mx.where(readable, 0.0, -mx.inf).astype(dtype)[None, None]
    # Kept for the next layer of the same pass (one entry: the last pass's).
    _FLASH_MASK[:] = [key, bias]
    return bias


def _flash_attention(q, parts, end, window, scale):
    """`_rotated_attention` as one mx.fast.scaled_dot_product_attention call: the
    codes decoded to the model dtype (rotated domain, scales folded in), sinks and the
    exact tail beside them, the reading rule as a mask. On CUDA that is cuDNN's fused
    attention: no L_q x L float32 scores in memory, one kernel instead of dozens of ops
    per block of queries (the blocked path prefilled 8k tokens 8x slower than mlx-lm
    and peaked at 5x its memory on the H200). q rotated, not scaled."""
    sinks, coded, tail = parts
    keys, values = [], []
    for part in (sinks, coded.decoded() if coded is not None else None, tail):
        if part is not None:
            keys.append(part[0])
            values.append(part[1])
    n_sink = 0 if sinks is None else sinks[0].shape[2]
    n_tail = 0 if tail is None else tail[0].shape[2]
    # Whole 128-key tiles (padding never read): the fused kernel's plans are per
    # shape, and tiles keep the bias rows aligned.
    width = -(-(end + n_tail) // 128) * 128
    if width > end + n_tail:
        pad = (*keys[0].shape[:2], width - end - n_tail)
        keys.append(mx.zeros((*pad, keys[0].shape[3]), keys[0].dtype))
        values.append(mx.zeros((*pad, values[0].shape[3]), values[0].dtype))
    bias = _flash_mask(q.shape[2], end, n_sink, n_tail, window, width, q.dtype)
    return mx.fast.scaled_dot_product_attention(
        q, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), scale=scale, mask=bias
    )


def _rotated_attention(q, parts, end, window, mask):
    """Attention of scaled, rotated queries q (B, Hq, L_q, d) at positions
    end - L_q .. end - 1 over the cached positions (sinks, then codes, with the exact
    tail overriding where a query's window reaches)."""
    sinks, coded, tail = parts
    B, n_q_heads, L_q, _ = q.shape
    n_sink = 0 if sinks is None else sinks[0].shape[2]
    n_kv_heads = sinks[0].shape[1] if sinks is not None else coded.n_kv_heads
    q = q.reshape(B, n_kv_heads, n_q_heads // n_kv_heads, L_q, -1)

    def keys_t(x):  # (B, Hkv, L, d) -> (B, Hkv, 1, d, L): shared by a group's heads
        return x[:, :, None].swapaxes(-1, -2)

    def grouped(x):  # (B, Hkv, L, d) -> (B, Hkv, 1, L, d)
        return x[:, :, None]

    scores = []
    if sinks is not None:
        scores.append((q @ keys_t(sinks[0])).astype(mx.float32))
    if coded is not None:
        scores.append(coded.scores(q))
    scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    total = scores.shape[-1]
    q_pos = mx.arange(end - L_q, end)[:, None]
    causal = q_pos >= mx.arange(total)[None]

    exact = None
    if tail is not None:
        n = tail[0].shape[2]
        t_pos = mx.arange(total - n, total)[None]
        # Sink positions are exact already and served by the sink term below.
        exact = (q_pos - t_pos < window) & (q_pos >= t_pos) & (t_pos >= n_sink)
        t_scores = (q @ keys_t(tail[0])).astype(mx.float32)
        last = mx.where(exact, t_scores, scores[..., total - n :])
        scores = mx.concatenate([scores[..., : total - n], last], axis=-1)

    if isinstance(mask, mx.array):
        if mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)  # the group axis
        if mask.dtype == mx.bool_:
            causal = causal & mask
        else:
            scores = scores + mask
    # None (a single query) and "causal" are both the causal mask at these positions.
    scores = mx.where(causal, scores, -mx.inf)
    p = mx.softmax(scores, axis=-1, precise=True)

    out = None
    if exact is not None:
        p_last = p[..., total - n :]
        out = mx.where(exact, p_last, 0).astype(q.dtype) @ grouped(tail[1])
        p = mx.concatenate([p[..., : total - n], mx.where(exact, 0, p_last)], axis=-1)
    if sinks is not None:
        o = p[..., :n_sink].astype(q.dtype) @ grouped(sinks[1])
        out = o if out is None else out + o
    if coded is not None:
        o = coded.values(p[..., n_sink:])
        out = o if out is None else out + o
    return out.reshape(B, n_q_heads, L_q, -1)


# --------------------------------------------------------------------------------------
# Hooking attention (optional, scoped)
# --------------------------------------------------------------------------------------

_PATCHED_MODULES: dict = {}  # module name -> (module, the binding it replaced)


def _attention_installed() -> bool:
    return bool(_PATCHED_MODULES)


def _wrap_turboquant(inner):
    """A drop-in for mlx_lm.models.base.scaled_dot_product_attention: our path for a
    routed TurboQuantKVCache, `inner` (whatever the module had) for any other cache."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if getattr(cache, "turboquant_step", False):  # a batch's layer (turboquant_batch)
            return cache.attention(queries, scale=scale, sinks=sinks)
        if isinstance(cache, TurboQuantKVCache) and cache.routed:
            # `keys`/`values` (the dequantized fetch) are left unused, so MLX's lazy
            # graph never computes them.
            return cache.attention(queries, scale=scale, mask=mask, sinks=sinks)
        return inner(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    sdpa.batchgen_turboquant = inner
    return sdpa


def _has_turboquant(fn) -> bool:
    """Whether `fn` is our wrapper, or wraps it (other load-time hooks chain through
    an attribute naming their inner function)."""
    while fn is not None:
        if hasattr(fn, "batchgen_turboquant"):
            return True
        fn = getattr(fn, "batchgen_short_attention", None)
    return False


def install_attention(model) -> List[str]:
    """Route the attention of `model`'s layers through `TurboQuantKVCache.attention`.

    mlx-lm's model files call `scaled_dot_product_attention`, imported by name from
    mlx_lm.models.base, with the layer's cache; there is no per-cache hook besides its
    `hasattr(cache, "bits")` branch, which assumes mx.quantized_matmul's affine format.
    So the name is rebound, in the model-file modules that `model` is built from only,
    to a function that takes the rotated-domain path for a TurboQuantKVCache and calls
    what was bound before for any other cache (behaviour for those is unchanged).
    Idempotent; `uninstall_attention()` restores the previous bindings. Returns the
    modules patched. Without it the cache still works (dequantize on fetch).
    """
    import sys

    names = {type(m).__module__ for _, m in model.named_modules()}
    patched = []
    for name in sorted(names):
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is None:
            continue
        if not _has_turboquant(fn):
            module.scaled_dot_product_attention = _wrap_turboquant(fn)
            _PATCHED_MODULES[name] = (module, fn)
        if name in _PATCHED_MODULES:
            patched.append(name)
    return patched


def uninstall_attention():
    """Undo `install_attention` for every module it patched."""
    for module, previous in _PATCHED_MODULES.values():
        module.scaled_dot_product_attention = previous
    _PATCHED_MODULES.clear()


# --------------------------------------------------------------------------------------
# Factory, save / load
# --------------------------------------------------------------------------------------


def make_turboquant_cache(
    model, bits: int = 4, *, seed: int = 0, rotated_attention: bool = True, **options
) -> List[Any]:
    """The model's cache list with every plain KVCache replaced by a TurboQuantKVCache.

    Recurrent (ArraysCache), rotating and other caches are kept as the model makes
    them. Layer i gets rotation seed `seed + i`. `options` go to TurboQuantKVCache
    (key_bits, value_bits, sink_tokens, window, trim_reserve).

    `rotated_attention` (default) also calls `install_attention(model)`, so attention
    runs in the rotated domain with each query's window read exactly, whatever the
    chunking (chunked prefill, prompt-cache reuse and prompt-lookup verification then
    match token-by-token decoding). With False, or where the model's attention does
    not go through mlx-lm's scaled_dot_product_attention, attention uses the
    dequantized keys/values that update_and_fetch returns.
    """
    resolve_bits(bits)
    routed = bool(rotated_attention and install_attention(model))
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
    else:
        caches = [KVCache() for _ in model.layers]
    out = []
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            c = TurboQuantKVCache(bits, seed=seed + i, **options)
            c.routed = routed
        out.append(c)
    return out


def register_with_mlx_lm():
    """Make mlx_lm.models.cache.load_prompt_cache able to rebuild our cache.

    load_prompt_cache looks classes up by name in mlx_lm.models.cache's globals; this
    adds the one name (nothing is replaced). Done on import of this module.
    """
    if getattr(mlx_cache, TurboQuantKVCache.__name__, None) is not TurboQuantKVCache:
        setattr(mlx_cache, TurboQuantKVCache.__name__, TurboQuantKVCache)


register_with_mlx_lm()

# Class names a prompt-cache loader must know besides mlx-lm's own.
CACHE_CLASSES = (TurboQuantKVCache.__name__,)


def save_prompt_cache(path: str, cache: List[Any], metadata: Optional[dict] = None):
    """mlx-lm's save_prompt_cache (a .safetensors file); TurboQuant layers included."""
    mlx_cache.save_prompt_cache(path, cache, metadata or {})


def load_prompt_cache(path: str, return_metadata: bool = False):
    """mlx-lm's load_prompt_cache, with TurboQuantKVCache registered first."""
    register_with_mlx_lm()
    return mlx_cache.load_prompt_cache(path, return_metadata=return_metadata)
