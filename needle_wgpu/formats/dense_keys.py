"""A dense GGUF file's metadata keys as llama.cpp reads them, each checked against its range
(spec §1): the readers `DenseGeometry.from_gguf` is written with. Pure Python."""

from __future__ import annotations

import math
import struct

from ..errors import ContainerError, UnsupportedModelError
from .gguf import ARRAY, INT_TYPES, REQUIRED, GgufFile

MAX_DIM = 1 << 20
MAX_LAYERS = 1024
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
MAX_EXPERTS = 1024


def bad(what: str, problem: str):
    raise ContainerError(f"{what}: {problem}")


def kv_heads(f: GgufFile, key, num_heads: int, num_layers: int, short_conv: bool) -> tuple:
    """(kv heads, short-convolution layers, taps): head_count_kv as llama.cpp reads it. lfm2
    (``short_conv``) may give one entry per layer, 0 marking a convolution block; the attention
    layers must then share one count."""
    name = key("attention.head_count_kv")
    entry = f.fields.get(name)
    if not short_conv or entry is None or entry.type != ARRAY:
        return count(f, name, default=num_heads), (), count(f, key("shortconv.l_cache"), lo=2, hi=64) \
            if short_conv else 0
    if entry.item_type not in INT_TYPES or len(entry.value) != num_layers:
        bad(f"metadata key {name!r}", f"expected {num_layers} integers (one per layer)")
    per_layer = [int(v) for v in entry.value]
    attention = sorted(set(n for n in per_layer if n))
    if len(attention) > 1 or not all(0 <= n <= num_heads for n in per_layer):
        raise UnsupportedModelError(f"metadata key {name!r}: kv heads {attention} vary by layer (one count "
                                    "for every attention layer is supported)")
    conv_layers = tuple(i for i, n in enumerate(per_layer) if n == 0)
    return (attention[0] if attention else num_heads), conv_layers, count(f, key("shortconv.l_cache"), lo=2, hi=64)


def multipliers(f: GgufFile, key) -> dict:
    """Granite's four multipliers as llama.cpp reads them (logit_scale required, the others
    optional; 0 means none). A file whose rope.scaling.finetuned is false runs without RoPE in
    llama.cpp: refused here rather than served rotated."""
    if not f.get_bool(key("rope.scaling.finetuned"), True):
        raise UnsupportedModelError(f"metadata key {key('rope.scaling.finetuned')!r}: false (no RoPE) is not supported")
    return {"embedding_multiplier": real(f, key("embedding_scale"), 0.0, 0.0, 1e6),
            "residual_multiplier": real(f, key("residual_scale"), 0.0, 0.0, 1e6),
            "attention_multiplier": real(f, key("attention.scale"), 0.0, 0.0, 1e6),
            "logit_scale": real(f, key("logit_scale"), REQUIRED, 1e-6, 1e6)}


def count(f: GgufFile, key: str, lo: int = 1, hi: int = MAX_DIM, default=REQUIRED) -> int:
    """An integer key in [lo, hi]; per-layer arrays (a few models vary widths by layer) are refused."""
    entry = f.fields.get(key)
    if entry is not None and entry.type == ARRAY:
        raise UnsupportedModelError(f"metadata key {key!r}: per-layer values are not supported")
    value = f.get_int(key, default)
    if not lo <= value <= hi:
        bad(f"metadata key {key!r}", f"{value} is out of range ({lo}..{hi})")
    return value


def factors(f: GgufFile, name: str, rope_dims: int) -> tuple:
    """The f32 values of a [rope_dims / 2] frequency-factor tensor (shape and type are checked
    with the other tensors; here the values: positive and finite, as divisors)."""
    t = f[name]
    if t.type.name != "F32" or t.ne != (rope_dims // 2,):
        bad(f"tensor {name!r}", f"expected F32 [{rope_dims // 2}], got {t.type.name} {list(t.ne)}")
    values = struct.unpack(f"<{rope_dims // 2}f", bytes(t.data))
    if not all(0.0 < v < math.inf for v in values):
        bad(f"tensor {name!r}", "frequency factors must be positive and finite")
    return values


def real(f: GgufFile, key: str, default: float, lo: float, hi: float) -> float:
    value = f.get_float(key, default)
    if not lo <= value <= hi:  # NaN fails both comparisons
        bad(f"metadata key {key!r}", f"{value} is out of range ({lo:g}..{hi:g})")
    return value


def rope_freq_scale(f: GgufFile, arch: str, accepted: tuple) -> float:
    """1 / factor, as llama.cpp reads it: rope.scale_linear, else rope.scaling.factor (0 = none)."""
    kind = f.get_str(f"{arch}.rope.scaling.type", "linear")
    if kind not in accepted:
        raise UnsupportedModelError(f"metadata key '{arch}.rope.scaling.type': {kind!r} RoPE scaling is not "
                                    f"supported (supported: {', '.join(accepted)})")
    factor_key = f"{arch}.rope.scale_linear"
    if factor_key not in f.fields:
        factor_key = f"{arch}.rope.scaling.factor"
    factor = f.get_float(factor_key, 0.0)
    if factor == 0.0:
        return 1.0
    if not 1e-3 <= factor <= 1e6:
        bad(f"metadata key {factor_key!r}", f"{factor} is out of range (0 or 0.001..1e6)")
    return 1.0 / factor
