"""``latents`` of ``POST /v1/images/generations``: base64 of a .npy float32 array, read
without pickle and without trusting its header's shape."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from ddm.serving.router.api.requests import parse_latents


def _npy(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_a_float32_array_round_trips_exactly():
    array = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
    parsed = parse_latents(_b64(_npy(array)))
    assert parsed.dtype == np.float32 and parsed.flags.c_contiguous
    np.testing.assert_array_equal(parsed, array)
    np.testing.assert_array_equal(parse_latents(_b64(_npy(np.asfortranarray(array)))), array)


@pytest.mark.parametrize("encoded,problem", [
    ("not base64!", "latents must be base64"),
    (_b64(b"PK\x03\x04 a zip"), "latents are not a .npy file"),
    (_b64(_npy(np.zeros((1, 4, 8, 8), np.float64))), "latents must be float32 .* got <f8"),
    (_b64(_npy(np.zeros((1, 4, 8, 8), ">f4"))), "latents must be float32 .* got >f4"),
    (_b64(_npy(np.array([{"a": 1}], dtype=object), allow_pickle=True)), "not objects"),
])
def test_anything_else_is_refused_naming_the_problem(encoded, problem):
    with pytest.raises(ValueError, match=problem):
        parse_latents(encoded)


def test_a_header_promising_more_than_the_file_holds_is_refused_before_allocating():
    """A 10^12-element header over 64 bytes of data: refused by arithmetic, never
    allocated (numpy's own reader would allocate the whole array first)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    forged = buffer.getvalue() + bytes(64)  # the magic, the header, 16 floats
    with pytest.raises(ValueError, match=r"header says shape \(1000000000000,\)"):
        parse_latents(_b64(forged))
