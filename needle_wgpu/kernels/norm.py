"""Row norms of the dense family (dense spec §3): rms_norm and the fused residual add + rms_norm.

Reference functions: ``reference.ops.rms_norm`` (and a plain f32 add for the residual stream).
Weights are f32 vectors at float offsets of one ``weights`` buffer (GGUF stores norms as F32).
"""

from __future__ import annotations

from ..constants import f32
from ..errors import UnsupportedModelError
from ..gpu.device import KernelKey, Plan, UniformArena

MAX_WIDTH = 1 << 16


def _check_width(op: str, width: int) -> None:
    if not 0 < width <= MAX_WIDTH:
        raise UnsupportedModelError(f"{op}: row width {width} (1 to {MAX_WIDTH})")


def rms_norm(plan: Plan, arena: UniformArena, *, x, weights, y, width: int, positions: int, eps: float,
             weight_at: int = 0, x_stride: int | None = None, x_offset: int = 0, y_stride: int | None = None,
             y_offset: int = 0, label: str = "rms_norm") -> None:
    """y[t] = x[t] · (1/sqrt(mean(x[t]²) + eps)) · w for T = ``positions`` rows of ``width``.

    Bindings (``rms_norm.wgsl``): 0 params, 1 ``x`` f32 [T][x_stride] from float ``x_offset``
    (read), 2 ``weights`` f32 (w at float ``weight_at``), 3 ``y`` f32 [T][y_stride] from
    ``y_offset``. Workgroups: (T,), 256 invocations. Constants: WIDTH. ``x_offset`` lets the
    final norm read only the last row of a chunk.
    """
    _check_width(label, width)
    key = KernelKey("rms_norm", consts=(("WIDTH", width),))
    params = arena.struct(key, x_stride=x_stride or width, x_offset=x_offset, y_stride=y_stride or width,
                          y_offset=y_offset, w_at=weight_at, eps=float(eps))
    plan.add(key, [params, x, weights, y], (positions,), label=label)


def add_rms_norm(plan: Plan, arena: UniformArena, *, x, residual, weights, y, width: int, positions: int,
                 eps: float, weight_at: int = 0, residual_weight_at: int | None = None, x_stride: int | None = None,
                 residual_stride: int | None = None, y_stride: int | None = None, residual_scale: float | None = None,
                 normed: bool = True, label: str = "add_rms_norm") -> None:
    """x[t] += r'[t]; y[t] = rms_norm(x[t]; w): the residual add fused with the next norm.

    r' = ``residual`` as it is, or, with ``residual_weight_at``, RMS-normed first with the
    weights there (Gemma 3: x1 = x + RMSNorm(attn; post_attention_norm), z = RMSNorm(x1;
    ffn_norm) in one dispatch), then times ``residual_scale`` when given (granite's
    residual_scale, as its f32). ``x`` is the residual stream, updated in place. ``normed``
    False: only the add (olmo2's sublayers read the stream itself; ``y`` is not written).

    Bindings (``add_rms_norm.wgsl``): 0 params, 1 ``x`` f32 [T][x_stride] (read_write), 2
    ``residual`` f32 [T][residual_stride] (read), 3 ``weights`` f32, 4 ``y`` f32 [T][y_stride].
    Workgroups: (T,), 256 invocations. Constants: WIDTH, RESIDUAL_NORM, RESIDUAL_SCALE, NORMED.
    """
    _check_width(label, width)
    key = KernelKey("add_rms_norm", consts=(("WIDTH", width), ("RESIDUAL_NORM", residual_weight_at is not None),
                                            ("RESIDUAL_SCALE", residual_scale is not None), ("NORMED", bool(normed))))
    params = arena.struct(key, x_stride=x_stride or width, r_stride=residual_stride or width,
                          y_stride=y_stride or width, w_at=weight_at, r_w_at=residual_weight_at or 0, eps=float(eps),
                          r_scale=f32(1.0 if residual_scale is None else residual_scale))
    plan.add(key, [params, x, residual, weights, y], (positions,), label=label)


def add_bias(plan: Plan, arena: UniformArena, *, y, bias, width: int, positions: int, bias_at: int = 0,
             y_stride: int | None = None, y_offset: int = 0, label: str = "add_bias") -> None:
    """y[t][j] += b[j] for T = ``positions`` rows of ``width`` (qwen2's output.bias).

    Bindings (``add_bias.wgsl``): 0 params, 1 ``bias`` f32 (b at float ``bias_at``), 2 ``y``
    f32 [T][y_stride] from ``y_offset`` (read_write). Workgroups: (ceil(width / 256), T), folded
    into z above 65,535 groups. Constant: WIDTH. Reference: a NumPy add.
    """
    if width < 1:
        raise UnsupportedModelError(f"{label}: width {width}")
    groups = -(-width // 256)
    z = -(-groups // 65535)
    key = KernelKey("add_bias", consts=(("WIDTH", width),))
    params = arena.struct(key, y_stride=y_stride or width, y_offset=y_offset, bias_at=bias_at)
    plan.add(key, [params, bias, y], (min(groups, 65535), positions, z), label=label)


def scale_softcap(plan: Plan, arena: UniformArena, *, y, width: int, positions: int, scale: float | None = None,
                  cap: float | None = None, y_stride: int | None = None, y_offset: int = 0,
                  label: str = "scale_softcap") -> None:
    """y = y · scale (when given), then y = tanh(y · f32(1 / cap)) · cap (when given), in place
    over T = ``positions`` rows of ``width``: granite's logits / logit_scale (pass the f32 of
    1 / logit_scale), gemma2's final-logit soft-capping. Reference: ``reference.ops.scale_softcap``.

    Bindings (``scale_softcap.wgsl``): 0 params, 1 ``y`` f32 [T][y_stride] from ``y_offset``
    (read_write). Workgroups: (ceil(width / 256), T), folded into z above 65,535 groups.
    Constants: WIDTH, SCALE, SOFTCAP.
    """
    if width < 1 or (scale is None and cap is None):
        raise UnsupportedModelError(f"{label}: width {width}, scale {scale}, cap {cap}")
    groups = -(-width // 256)
    z = -(-groups // 65535)
    key = KernelKey("scale_softcap", consts=(("WIDTH", width), ("SCALE", scale is not None), ("SOFTCAP", cap is not None)))
    params = arena.struct(key, y_stride=y_stride or width, y_offset=y_offset, scale=f32(scale or 1.0),
                          cap=f32(cap or 1.0), inv_cap=f32(1.0 / f32(cap or 1.0)))
    plan.add(key, [params, y], (min(groups, 65535), positions, z), label=label)
