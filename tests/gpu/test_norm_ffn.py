"""rms_norm, add_rms_norm and the gated FFN activations on the GPU vs NumPy (dense spec §3)."""

import numpy as np
import pytest

from needle_wgpu.errors import UnsupportedModelError
from needle_wgpu.gpu import Plan, UniformArena
from needle_wgpu.kernels import ffn, norm
from needle_wgpu.reference.ops import gelu_gated, rms_norm, scale_softcap, swiglu

from .parity import GATE, download, rel, upload

pytestmark = pytest.mark.gpu
F32 = np.float32


def rows(rng, n, width):
    scale = rng.uniform(0.1, 30.0, size=(n, 1))  # rows of very unequal size, as residual streams
    return (rng.normal(size=(n, width)) * scale).astype(F32)


def run(device, build):
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "norm_ffn")
    build(plan, arena)
    device.run(plan)


@pytest.mark.parametrize("width, eps", [(64, 1e-6), (576, 1e-5), (640, 1e-6), (1000, 1e-5), (2048, 1e-6)])
def test_rms_norm(device, width, eps):
    rng = np.random.default_rng(width)
    T = 5
    x = rows(rng, T, width + 3)  # stride wider than the row
    w = (1 + 0.5 * rng.normal(size=width)).astype(F32)
    weights = np.concatenate((np.zeros(7, F32), w))  # the weights at float offset 7
    xb, wb = upload(device, x, "x"), upload(device, weights, "weights")
    y = device.buffer(4 * T * width, label="y")
    run(device, lambda plan, arena: norm.rms_norm(plan, arena, x=xb, weights=wb, y=y, width=width, positions=T,
                                                  eps=eps, weight_at=7, x_stride=width + 3))
    assert rel(download(device, y, (T, width)), rms_norm(x[:, :width], w, eps)) <= GATE
    # the last row only (x_offset), into row 0 of a one-row output
    last = device.buffer(4 * width, label="last")
    run(device, lambda plan, arena: norm.rms_norm(plan, arena, x=xb, weights=wb, y=last, width=width, positions=1,
                                                  eps=eps, weight_at=7, x_offset=(T - 1) * (width + 3)))
    assert rel(download(device, last, (1, width)), rms_norm(x[-1:, :width], w, eps)) <= GATE


def test_rms_norm_zero_row(device):
    """An all-zero row normalises to zeros (eps keeps the division finite)."""
    x, w = np.zeros((2, 64), F32), np.ones(64, F32)
    x[1] = 1e-30
    y = device.buffer(4 * 128, label="y")
    run(device, lambda plan, arena: norm.rms_norm(plan, arena, x=upload(device, x, "x"), weights=upload(device, w, "w"),
                                                  y=y, width=64, positions=2, eps=1e-6))
    got = download(device, y, (2, 64))
    assert np.isfinite(got).all() and not got[0].any()
    assert rel(got, rms_norm(x, w, 1e-6)) <= GATE  # row 1: x² underflows to 0, y = x / sqrt(eps)


@pytest.mark.parametrize("post_norm", [False, True], ids=["plain", "gemma-post-norm"])
@pytest.mark.parametrize("width", [64, 640, 1000])
def test_add_rms_norm(device, width, post_norm):
    """x <- x + r' written exactly as NumPy's f32 add; y = rms_norm(x) within the gate."""
    rng = np.random.default_rng(width + post_norm)
    T = 4
    x, r = rows(rng, T, width), rows(rng, T, width)
    w, wr = ((1 + 0.5 * rng.normal(size=(2, width))).astype(F32))
    weights = np.concatenate((w, np.zeros(5, F32), wr))
    xb, rb, wb = upload(device, x, "x"), upload(device, r, "r"), upload(device, weights, "weights")
    y = device.buffer(4 * T * width, label="y")
    run(device, lambda plan, arena: norm.add_rms_norm(
        plan, arena, x=xb, residual=rb, weights=wb, y=y, width=width, positions=T, eps=1e-6,
        residual_weight_at=width + 5 if post_norm else None))
    got_sum = download(device, xb, (T, width))
    if post_norm:
        want_sum = x + rms_norm(r, wr, 1e-6)
        assert rel(got_sum, want_sum) <= GATE
    else:
        want_sum = x + r
        np.testing.assert_array_equal(got_sum, want_sum)
    assert rel(download(device, y, (T, width)), rms_norm(want_sum, w, 1e-6)) <= GATE


@pytest.mark.parametrize("normed", [True, False], ids=["normed", "add-only"])
def test_add_rms_norm_residual_scale(device, normed):
    """Granite's residual_scale: x <- x + r · s, exactly NumPy's two f32 operations; without
    ``normed`` (olmo2) y is left as it was."""
    rng = np.random.default_rng(11)
    T, width = 3, 640
    x, r = rows(rng, T, width), rows(rng, T, width)
    w = (1 + 0.5 * rng.normal(size=width)).astype(F32)
    xb, rb, wb = upload(device, x, "x"), upload(device, r, "r"), upload(device, w, "weights")
    y0 = np.full((T, width), 7.0, F32)
    y = upload(device, y0, "y")
    run(device, lambda plan, arena: norm.add_rms_norm(
        plan, arena, x=xb, residual=rb, weights=wb, y=y, width=width, positions=T, eps=1e-6, residual_scale=0.22,
        normed=normed))
    want_sum = x + r * F32(0.22)
    np.testing.assert_array_equal(download(device, xb, (T, width)), want_sum)
    if normed:
        assert rel(download(device, y, (T, width)), rms_norm(want_sum, w, 1e-6)) <= GATE
    else:
        np.testing.assert_array_equal(download(device, y, (T, width)), y0)


@pytest.mark.parametrize("scale, cap", [(0.125, None), (None, 30.0), (2.0, 50.0)],
                         ids=["granite-logit-scale", "gemma2-softcap", "both"])
def test_scale_softcap(device, scale, cap):
    """In place over rows with a stride and offset: the scale exact (one f32 product), the cap
    within a few ulps of NumPy's tanh; the rest of y untouched."""
    rng = np.random.default_rng(3)
    T, width, stride = 2, 49157, 49160
    y0 = (rng.normal(size=(T + 1) * stride) * 40).astype(F32)
    y0[stride:stride + 6] = (-1e30, -200.0, -0.0, 0.0, 1e-30, 1e30)
    yb = upload(device, y0, "y")
    run(device, lambda plan, arena: norm.scale_softcap(plan, arena, y=yb, width=width, positions=T, scale=scale,
                                                       cap=cap, y_stride=stride, y_offset=stride))
    got = download(device, yb, ((T + 1) * stride,))
    want = y0.copy()
    for t in range(T):
        start = (t + 1) * stride
        want[start:start + width] = scale_softcap(y0[start:start + width], scale, cap)
    np.testing.assert_array_equal(got[:stride], y0[:stride])
    if cap is None:
        np.testing.assert_array_equal(got, want)
    else:
        capped = np.concatenate([got[(t + 1) * stride:(t + 1) * stride + width] for t in range(T)])
        assert np.isfinite(got).all() and np.abs(capped).max() <= cap
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * cap)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("width", [64, 1536, 1000])
def test_gated_activation(device, act, width):
    """A fused gate|up buffer (g at 0, u at width + 8, stride 2·width + 8), random and extreme g."""
    rng = np.random.default_rng(width + len(act))
    T = 3
    stride = 2 * width + 8
    fused = (rng.normal(size=(T, stride)) * 3).astype(F32)
    fused[0, :16] = (-1e30, -1e4, -100.0, -88.0, -20.0, -5.0, -1e-3, 0.0,
                     1e-3, 5.0, 20.0, 88.0, 100.0, 1e4, 1e30, -0.0)
    g, u = fused[:, :width], fused[:, width + 8 : 2 * width + 8]
    u[0, 14] = 1e-3  # keep 1e30 · u finite
    buf = upload(device, fused, "gate_up")
    out = device.buffer(4 * T * width, label="act")
    op = ffn.swiglu if act == "silu" else ffn.gelu_gated
    run(device, lambda plan, arena: op(plan, arena, gate=buf, up=buf, out=out, width=width, positions=T,
                                       gate_stride=stride, up_stride=stride, up_offset=width + 8))
    got = download(device, out, (T, width))
    want = swiglu(g, u) if act == "silu" else gelu_gated(g, u)
    assert np.isfinite(got).all() and np.isfinite(want).all()
    # The extremes are far larger than the rest: gate them on their own row. Saturation is
    # exact; for g near -5 the spec's 1 + tanh(z) cancels to ~1e-7, so one ulp of tanh (GPU
    # vs NumPy) is an absolute 1e-7·|g·u|: atol covers that, rtol the rest.
    np.testing.assert_allclose(got[0, :16], want[0, :16], rtol=2e-6, atol=2e-6)
    assert rel(got[1:], want[1:]) <= GATE


def test_checks(device):
    arena, plan = UniformArena(device, capacity=1 << 12), Plan(device, "checks")
    buf = device.buffer(64, label="scratch")
    with pytest.raises(ValueError):
        ffn.gated_activation(plan, arena, gate=buf, up=buf, out=buf, width=8, positions=1, act="relu")
    with pytest.raises(UnsupportedModelError):
        norm.rms_norm(plan, arena, x=buf, weights=buf, y=buf, width=0, positions=1, eps=1e-6)


@pytest.mark.parametrize("width", [7, 300, 49152])
def test_add_bias(device, width):
    """y[t][j] += b[j] over rows with a stride and offset; the rest of y is untouched (exact:
    one f32 addition per element)."""
    rng = np.random.default_rng(width)
    T, stride = 3, width + 5
    y0 = rng.normal(size=(T + 1) * stride).astype(F32)
    b = rng.normal(size=width).astype(F32)
    yb = upload(device, y0, "y")
    bb = upload(device, np.concatenate((np.zeros(64, F32), b)), "bias")
    run(device, lambda plan, arena: norm.add_bias(plan, arena, y=yb, bias=bb, width=width, positions=T,
                                                  bias_at=64, y_stride=stride, y_offset=stride))
    want = y0.copy()
    for t in range(T):
        start = (t + 1) * stride
        want[start:start + width] += b
    np.testing.assert_array_equal(download(device, yb, ((T + 1) * stride,)), want)
