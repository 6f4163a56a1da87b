"""LFM2's gated short convolution on the GPU vs ``reference.ops.short_conv`` (dense spec §3):
one prefill, chunks, and decode steps give the same bits; each equals the reference."""

import numpy as np
import pytest

from needle_wgpu.errors import DeviceLimitError
from needle_wgpu.gpu import Binding, Plan, UniformArena
from needle_wgpu.kernels import conv
from needle_wgpu.reference.ops import short_conv

from .parity import GATE, download, rel, upload

pytestmark = pytest.mark.gpu
F32 = np.float32


def run_chunks(device, bcx, weights, chunks, width, taps, chunk):
    """The rows of bcx in the given chunk sizes through one ring; returns y of every position."""
    slots = conv.ring_slots(chunk, taps)
    ring = device.buffer(4 * slots * width, label="ring")
    packed = np.concatenate((np.zeros(5, F32), weights.reshape(-1)))  # the weights at float offset 5
    weights_buf = upload(device, packed, "weights")
    stride = 3 * width + 4
    out, pos0 = [], 0
    for n in chunks:
        rows = np.zeros((n, stride), F32)
        rows[:, :3 * width] = bcx[pos0:pos0 + n]
        bcx_buf = upload(device, rows, "bcx")
        y = device.buffer(4 * n * width, label="y")
        step = device.buffer(16, label="step", usage="uniform", data=np.array([pos0, 0, 0, 0], np.uint32).tobytes())
        arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "short_conv")
        conv.short_conv(plan, arena, Binding(step), bcx=bcx_buf, weights=weights_buf, ring=ring, y=y, width=width,
                        taps=taps, positions=n, slots=slots, weight_at=5, bcx_stride=stride)
        device.run(plan)
        out.append(download(device, y, (n, width)))
        pos0 += n
    return np.concatenate(out)


@pytest.mark.parametrize("width, taps", [(64, 3), (1024, 3), (100, 4)])
def test_short_conv_prefill_chunks_and_decode(device, width, taps):
    rng = np.random.default_rng(width + taps)
    N = 21
    bcx = rng.normal(size=(N, 3 * width)).astype(F32)
    weights = rng.normal(size=(width, taps)).astype(F32)
    want, tail = short_conv(bcx, weights)
    got = [run_chunks(device, bcx, weights, chunks, width, taps, chunk=8) for chunks in ((8, 8, 5), (1,) * N)]
    assert rel(got[0], want) <= GATE
    np.testing.assert_array_equal(got[0], got[1])  # decode = prefill, bit for bit
    # the reference carries its state across chunks the same way
    first, state = short_conv(bcx[:8], weights)
    rest, _ = short_conv(bcx[8:], weights, state)
    np.testing.assert_array_equal(np.concatenate((first, rest)), want)
    assert np.array_equal(tail, (bcx[-(taps - 1):, :width] * bcx[-(taps - 1):, 2 * width:]))
    # position 0 sees only its own bx (the taps before it are absent, not garbage)
    np.testing.assert_allclose(got[0][0], bcx[0, width:2 * width] * weights[:, -1] * bcx[0, :width] * bcx[0, 2 * width:],
                               rtol=1e-6)


def test_short_conv_refuses_a_ring_too_small(device):
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "checks")
    buf = device.buffer(64, label="scratch")
    with pytest.raises(DeviceLimitError):
        conv.short_conv(plan, arena, buf, bcx=buf, weights=buf, ring=buf, y=buf, width=4, taps=3, positions=8, slots=9)
