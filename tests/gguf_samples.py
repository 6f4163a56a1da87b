"""Tiny GGUF files for the reader tests, built byte by byte so a test can break any field.

``build_gguf`` writes exactly what it is given (counts, lengths and type ids may lie) and
returns the file with a ``Layout``: the byte offset of every field a mutation may want to edit.
The valid files it writes are checked against gguf-py's ``GGUFReader`` (tests/test_gguf.py), so
the builder itself is known to follow the format. ``dense_gguf`` makes a small valid model of
each architecture of spec §1-§2 (random block bytes: the reader never dequantises).
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

from needle_wgpu.formats import gguf as G
from needle_wgpu.formats.dense_archs import ARCHITECTURES
from needle_wgpu.formats.gguf_types import BY_NAME

_CODES = {G.UINT8: "B", G.INT8: "b", G.UINT16: "H", G.INT16: "h", G.UINT32: "I", G.INT32: "i",
          G.FLOAT32: "f", G.BOOL: "B", G.UINT64: "Q", G.INT64: "q", G.FLOAT64: "d"}


@dataclass
class Layout:
    """Offsets in the built file. Lists hold one entry per occurrence, in file order."""

    counts_at: int = 8  # u64 tensor count; the metadata count follows at 16
    string_lengths: list = field(default_factory=list)  # every u64 string length (keys, values, names)
    string_bytes: list = field(default_factory=list)  # (offset, length) of every string's bytes
    value_types: list = field(default_factory=list)  # u32 value type of each entry, and array item types
    array_counts: list = field(default_factory=list)  # u64 count of every array
    n_dims: list = field(default_factory=list)  # u32 n_dims of each tensor info
    ne: list = field(default_factory=list)  # offset of ne[0] of each tensor info
    tensor_types: list = field(default_factory=list)  # u32 type of each tensor info
    tensor_offsets: list = field(default_factory=list)  # u64 offset of each tensor info
    info_spans: list = field(default_factory=list)  # (start, end) of each tensor info
    infos_end: int = 0  # end of the tensor infos, before the padding
    data_start: int = 0


def _string(out: bytearray, text, layout: Layout) -> None:
    raw = text if isinstance(text, bytes) else text.encode()
    layout.string_lengths.append(len(out))
    out += struct.pack("<Q", len(raw))
    layout.string_bytes.append((len(out), len(raw)))
    out += raw


def _value(out: bytearray, vtype: int, value, layout: Layout) -> None:
    """Append one value; an array value is (item_type, items), nested arrays recursively."""
    if vtype == G.STRING:
        _string(out, value, layout)
    elif vtype == G.ARRAY:
        item_type, items = value
        layout.value_types.append(len(out))
        out += struct.pack("<I", item_type)
        layout.array_counts.append(len(out))
        out += struct.pack("<Q", len(items))
        for item in items:
            _value(out, item_type, item, layout)
    else:
        out += struct.pack("<" + _CODES[vtype], value)


def build_gguf(kvs, tensors, *, version=3, alignment=32, magic=b"GGUF") -> tuple:
    """(file bytes, Layout). kvs: (key, vtype, value); tensors: (name, ne, type_id, data) laid out
    in order at aligned offsets, the last one ending the file. ``alignment`` only places the
    data: add the ``general.alignment`` entry yourself."""
    layout = Layout()
    out = bytearray(magic + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for key, vtype, value in kvs:
        _string(out, key, layout)
        layout.value_types.append(len(out))
        out += struct.pack("<I", vtype)
        _value(out, vtype, value, layout)
    offsets, at = [], 0
    for _, _, _, data in tensors:
        offsets.append(at)
        at = (at + len(data) + alignment - 1) // alignment * alignment
    for (name, ne, type_id, _), offset in zip(tensors, offsets):
        start = len(out)
        _string(out, name, layout)
        layout.n_dims.append(len(out))
        out += struct.pack("<I", len(ne))
        layout.ne.append(len(out))
        out += struct.pack(f"<{len(ne)}Q", *ne)
        layout.tensor_types.append(len(out))
        out += struct.pack("<I", type_id)
        layout.tensor_offsets.append(len(out))
        out += struct.pack("<Q", offset)
        layout.info_spans.append((start, len(out)))
    layout.infos_end = len(out)
    layout.data_start = (len(out) + alignment - 1) // alignment * alignment
    out += bytes(layout.data_start - len(out))
    for (_, _, _, data), offset in zip(tensors, offsets):
        out += bytes(layout.data_start + offset - len(out)) + data
    return bytes(out), layout


def tensor_bytes(rng: random.Random, type_name: str, ne) -> bytes:
    """Random block bytes for a tensor (F32 tensors get small finite floats)."""
    t = BY_NAME[type_name]
    count = 1
    for dim in ne:
        count *= dim
    if type_name == "F32":
        return struct.pack(f"<{count}f", *(rng.uniform(-1, 1) for _ in range(count)))
    return rng.randbytes(count // t.block_size * t.type_size)


# ----------------------------------------------------------------------------------- dense models

ARCH_DEFAULTS = dict(layers=2, d=64, heads=4, kv_heads=2, head_dim=16, ff=128, vocab=256, context=512)


def dense_kvs(arch: str, *, layers, d, heads, kv_heads, head_dim, ff, vocab, context, experts=4,
              experts_used=2, tokenizer=True) -> list:
    k = arch + "."
    kvs = [("general.architecture", G.STRING, arch), ("general.name", G.STRING, f"tiny {arch}"),
           (k + "block_count", G.UINT32, layers), (k + "context_length", G.UINT32, context),
           (k + "embedding_length", G.UINT32, d), (k + "feed_forward_length", G.UINT32, ff),
           (k + "attention.head_count", G.UINT32, heads), (k + "attention.head_count_kv", G.UINT32, kv_heads),
           (k + "attention.key_length", G.UINT32, head_dim), (k + "attention.value_length", G.UINT32, head_dim),
           (k + "rope.freq_base", G.FLOAT32, 10000.0),
           (k + "attention.layer_norm_rms_epsilon", G.FLOAT32, 1e-6)]
    rules = ARCHITECTURES[arch]
    if rules.moe:
        kvs += [(k + "expert_count", G.UINT32, experts), (k + "expert_used_count", G.UINT32, experts_used)]
        if rules.expert_width_key:
            kvs.append((k + rules.expert_width_key, G.UINT32, ff))
    if rules.sliding_every:
        kvs.append((k + "attention.sliding_window", G.UINT32, 8))
    if rules.short_conv:  # lfm2: its taps (a scalar head_count_kv: every layer attends)
        kvs.append((k + "shortconv.l_cache", G.UINT32, 3))
    if rules.multipliers:  # granite: only logit_scale is required
        kvs.append((k + "logit_scale", G.FLOAT32, 8.0))
    if tokenizer:
        tokens = [f"t{i}" if i % 7 else f"Ġé漢{i}" for i in range(vocab)]
        kvs += [("tokenizer.ggml.model", G.STRING, "gpt2"),
                ("tokenizer.ggml.tokens", G.ARRAY, (G.STRING, tokens)),
                ("tokenizer.ggml.token_type", G.ARRAY, (G.INT32, [1] * (vocab - 2) + [3, 3])),
                ("tokenizer.ggml.merges", G.ARRAY, (G.STRING, [f"t {i}" for i in range(1, 40)])),
                ("tokenizer.ggml.bos_token_id", G.UINT32, vocab - 2),
                ("tokenizer.ggml.add_bos_token", G.BOOL, False)]
    return kvs


def dense_tensors(geometry, rng: random.Random, qtype: str = "Q8_0") -> list:
    """(name, ne, type_id, bytes) of every tensor a geometry expects: vectors F32, matrices qtype."""
    out = []
    for name, ne in geometry.tensors():
        type_name = "F32" if len(ne) == 1 else qtype
        out.append((name, ne, BY_NAME[type_name].id, tensor_bytes(rng, type_name, ne)))
    return out


def dense_gguf(arch: str = "llama", **options) -> bytes:
    """A small valid model file of one architecture; options as for ``dense_parts``."""
    return build_gguf(*dense_parts(arch, **options))[0]


def dense_parts(arch: str = "llama", *, tied: bool = True, qtype: str = "Q8_0", seed: int = 0, keys=None,
                tensors_fn=None, qkv_bias=None, output_bias=False, **sizes) -> tuple:
    """(kvs, tensors) of a small valid model (sizes as ARCH_DEFAULTS) for ``build_gguf``. ``keys``
    edits the metadata: key -> (vtype, value) replaces or adds an entry, key -> None drops it;
    ``tensors_fn`` may edit the (name, ne, type_id, bytes) list."""
    from needle_wgpu.formats.dense_geometry import DenseGeometry

    values, rules = {**ARCH_DEFAULTS, **sizes}, ARCHITECTURES[arch]
    tied = tied and not rules.output_required
    experts = 4 if rules.moe else 0
    geometry = DenseGeometry(
        arch=arch, num_layers=values["layers"], d_model=values["d"], ff_dim=values["ff"],
        num_heads=values["heads"], num_kv_heads=values["kv_heads"], key_dim=values["head_dim"],
        value_dim=values["head_dim"], rope_dims=values["head_dim"], rope_base=10000.0,
        rope_freq_scale=1.0, rms_eps=1e-6, vocab=values["vocab"], context_length=values["context"],
        tied_head=tied, qkv_bias=rules.qkv_bias == "required" if qkv_bias is None else qkv_bias,
        output_bias=output_bias, num_experts=experts, num_experts_used=2 if experts else 0)
    tensors = dense_tensors(geometry, random.Random(seed), qtype)
    if tensors_fn is not None:
        tensors = tensors_fn(tensors)
    edits, kvs = dict(keys or {}), []
    for key, vtype, value in dense_kvs(arch, **values):
        edit = edits.pop(key, (vtype, value))
        if edit is not None:
            kvs.append((key, *edit))
    kvs += [(key, *edit) for key, edit in edits.items() if edit is not None]
    return kvs, tensors
