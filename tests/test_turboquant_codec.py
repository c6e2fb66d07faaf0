"""TurboQuant's codec (turboquant/codec.py): codebooks, packing, rotation, distortion."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from batchgen.turboquant import codec as tq

# Expected squared error of a unit vector, E||x - x_hat||^2, for the MSE-optimal
# scalar quantizer: d x the per-coordinate Lloyd-Max cost of N(0, 1/d). The
# paper (Theorem 1) quotes these rounded as ~0.117, ~0.03, ~0.009 for b = 2, 3, 4;
# the exact costs are 0.1175, 0.03455, 0.009501 (3 bits is 0.0345, not 0.030).
REFERENCE_MSE = {2: 0.1175, 3: 0.03455, 4: 0.009501}


def unit_vectors(n: int, d: int, seed: int = 0) -> mx.array:
    x = mx.random.normal((n, d), key=mx.random.key(seed))
    return x / mx.linalg.norm(x, axis=-1, keepdims=True)




@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_codebook_table_is_lloyd_max_of_the_gaussian(bits):
    levels = tq.codebook(bits).astype(np.float64)
    np.testing.assert_allclose(tq.lloyd_max_codebook(bits), levels, atol=2e-6)
    # Independently of the helper: each level is the mean of N(0, 1) over its cell,
    # the cells split at midpoints (closed form: (phi(a) - phi(b)) / (Phi(b) - Phi(a))).
    edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    cdf = np.array([0.5 * (1 + math.erf(e / math.sqrt(2))) for e in edges])
    pdf = np.exp(-0.5 * np.nan_to_num(edges, posinf=50, neginf=-50) ** 2)
    centroids = (pdf[:-1] - pdf[1:]) / math.sqrt(2 * math.pi) / np.diff(cdf)
    np.testing.assert_allclose(centroids, levels, atol=2e-6)


def test_beta_codebook_tends_to_the_gaussian_table():
    # The exact coordinate law of a rotated unit vector in dim d approaches N(0, 1/d).
    far = np.abs(tq.lloyd_max_codebook(4, 16) - tq.codebook(4)).max()
    near = np.abs(tq.lloyd_max_codebook(4, 512) - tq.codebook(4)).max()
    assert near < 0.03 < far


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_distortion_matches_the_paper(dim, bits):
    x = unit_vectors(4000, dim, seed=bits)
    rot = tq.rotation(dim, 0)
    words, norms = tq.quantize(x, bits, rot)
    x_hat = tq.dequantize(words, norms, bits, rot)
    mse = mx.mean(mx.sum((x_hat - x) ** 2, axis=-1)).item()
    assert abs(mse - REFERENCE_MSE[bits]) < 0.10 * REFERENCE_MSE[bits], mse


def test_more_bits_less_error():
    x = unit_vectors(1000, 128)
    rot = tq.rotation(128, 3)
    errs = [
        mx.mean((tq.dequantize(*tq.quantize(x, b, rot), b, rot) - x) ** 2).item()
        for b in (2, 3, 4, 5)
    ]
    assert errs == sorted(errs, reverse=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [16, 64, 80, 128])
def test_pack_unpack_round_trip(bits, count):
    codes = mx.random.randint(0, 2**bits, (2, 3, count), key=mx.random.key(bits))
    codes = codes.astype(mx.uint32)
    words = tq.pack_codes(codes, bits)
    assert words.dtype == mx.uint32
    assert words.shape == (2, 3, tq.packed_words(count, bits))
    assert mx.array_equal(tq.unpack_codes(words, bits, count), codes)


def test_packing_is_compact():
    # 3-bit codes straddle word boundaries: 128 codes = 384 bits = 12 words exactly.
    assert tq.packed_words(128, 3) == 12
    assert tq.packed_words(128, 4) == 16
    assert tq.packed_words(64, 2) == 4
    assert tq.packed_words(64, 5) == 10


def test_pack_known_layout():
    # Code i occupies bits [3i, 3i + 3) of the little-endian bit stream.
    codes = mx.zeros((32,), mx.uint32)
    codes[10] = 7  # bits 30..32: straddles words 0 and 1
    words = np.array(tq.pack_codes(codes, 3))
    assert words.tolist() == [0b11 << 30, 0b1, 0]


@pytest.mark.parametrize("dim", [16, 64, 128, 80, 96])
def test_rotation_is_orthogonal(dim):
    rot = tq.rotation(dim, 1)
    assert rot.hadamard == (dim & (dim - 1) == 0)
    eye = mx.eye(dim)
    m = rot.forward(eye)
    assert mx.allclose(m @ m.T, eye, atol=1e-5)
    x = mx.random.normal((50, dim), key=mx.random.key(2))
    y = rot.forward(x)
    assert mx.allclose(
        mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1), rtol=1e-5
    )
    assert mx.allclose(rot.inverse(y), x, atol=1e-5)


def test_rotation_is_seeded():
    x = mx.random.normal((4, 64), key=mx.random.key(0))
    a = tq.Rotation(64, 5).forward(x)
    assert mx.array_equal(a, tq.Rotation(64, 5).forward(x))
    assert not mx.allclose(a, tq.Rotation(64, 6).forward(x))


def test_outlier_channel_is_spread_by_the_rotation():
    # A key dominated by one channel: after the rotation every coordinate carries
    # 1/sqrt(d) of it, so the codebook (not a per-group range) bounds the error.
    x = mx.zeros((1, 128))
    x[0, 3] = 50.0
    x = x + 0.1 * mx.random.normal((1, 128), key=mx.random.key(1))
    rot = tq.rotation(128, 0)
    y = rot.forward(x) / mx.linalg.norm(x)
    assert mx.abs(y).max().item() < 3.5 / math.sqrt(128)
