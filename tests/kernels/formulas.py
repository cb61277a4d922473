"""Plain float64 formulas the kernel tests check kernels and their
``reference()`` functions against.  Nothing here imports a kernel module:
each formula is written out from its published definition, element by
element where that keeps it obvious."""

from __future__ import annotations

import math

import numpy as np


def llama3_inv_freq(theta, head_dim, factor=None, low_freq_factor=None, high_freq_factor=None,
                    original_context=None):
    """RoPE inverse frequencies ``theta ** (-2i / head_dim)``, with Llama 3.1's
    rescaling when ``factor`` is given.

    Llama 3.1 (Meta's published ``rope_scaling``: factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) keeps a frequency
    whose wavelength ``2 pi / f`` is shorter than ``original / high``,
    divides by ``factor`` one whose wavelength is longer than ``original /
    low``, and in between blends the two linearly in ``original /
    wavelength``: ``f * ((1 - t) / factor + t)`` with ``t = (original /
    wavelength - low) / (high - low)``.
    """
    out = []
    for i in range(head_dim // 2):
        f = theta ** (-(2.0 * i) / head_dim)
        if factor is not None:
            wavelength = 2.0 * math.pi / f
            if wavelength > original_context / low_freq_factor:
                f = f / factor
            elif wavelength >= original_context / high_freq_factor:
                t = ((original_context / wavelength - low_freq_factor)
                     / (high_freq_factor - low_freq_factor))
                f = f * ((1.0 - t) / factor + t)
        out.append(f)
    return np.array(out, dtype=np.float64)


def smoothed_band(theta, head_dim, low_freq_factor, high_freq_factor, original_context):
    """Indices of the frequencies Llama 3.1 blends (between the two wavelengths)."""
    idx = []
    for i in range(head_dim // 2):
        wavelength = 2.0 * math.pi * theta ** ((2.0 * i) / head_dim)
        if original_context / high_freq_factor <= wavelength <= original_context / low_freq_factor:
            idx.append(i)
    return idx


def rope_rotate(x, pos, inv_freq, layout):
    """Rotate each pair of ``x[..., d]`` by ``pos * inv_freq[i]`` (float64).

    ``layout="neox"`` pairs ``(x[i], x[i + d/2])``, ``"interleaved"`` pairs
    ``(x[2i], x[2i + 1])``; ``(a, b) -> (a cos - b sin, a sin + b cos)``.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    out = np.empty_like(x)
    for i in range(d // 2):
        ia, ib = (i, i + d // 2) if layout == "neox" else (2 * i, 2 * i + 1)
        ang = pos * float(inv_freq[i])
        c, s = math.cos(ang), math.sin(ang)
        out[..., ia] = x[..., ia] * c - x[..., ib] * s
        out[..., ib] = x[..., ia] * s + x[..., ib] * c
    return out


def rmsnorm(x, w, eps):
    """``x / sqrt(sum(x**2) / n + eps) * w`` per row, sums by ``math.fsum``."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    w = np.asarray(w, dtype=np.float64)
    out = np.empty_like(x)
    for r, row in enumerate(x):
        ms = math.fsum(float(v) * float(v) for v in row) / row.size
        out[r] = row / math.sqrt(ms + eps) * w
    return out


def swiglu(g, u):
    """``silu(g) * u`` with ``silu(g) = g * sigmoid(g)``, the sigmoid taken
    element by element as ``e / (1 + e)`` with ``e = exp(-|g|)`` for
    negative ``g`` and ``1 / (1 + e)`` otherwise (no cancellation)."""
    out = []
    for a, b in zip(np.ravel(np.asarray(g, np.float64)), np.ravel(np.asarray(u, np.float64))):
        e = math.exp(-abs(a))
        sig = e / (1.0 + e) if a < 0 else 1.0 / (1.0 + e)
        out.append(a * sig * b)
    return np.array(out).reshape(np.shape(g))


def geglu(g, u):
    """``gelu(g) * u`` with GELU's tanh form, ``g/2 (1 + tanh(z))``, ``z =
    sqrt(2/pi) (g + 0.044715 g^3)``, element by element as ``g sigmoid(2 z)``
    (the same number, ``(1 + tanh z) / 2 = sigmoid(2 z)``), the sigmoid split
    by the sign of z as in :func:`swiglu` (no cancellation)."""
    c = math.sqrt(2.0 / math.pi)
    out = []
    for a, b in zip(np.ravel(np.asarray(g, np.float64)), np.ravel(np.asarray(u, np.float64))):
        z2 = 2.0 * c * (a + 0.044715 * a ** 3)
        e = math.exp(-abs(z2))
        sig = e / (1.0 + e) if z2 < 0 else 1.0 / (1.0 + e)
        out.append(a * sig * b)
    return np.array(out).reshape(np.shape(g))
