"""The dense GGUF family on the GPU (the architectures of `formats/dense_archs.py`):
weights uploaded once in their quantised bits, sessions with a preallocated KV cache, and the prebuilt dispatch plan of
spec dense-gguf §3 read top to bottom as the model's forward.

Per layer and chunk (9 dispatches when q/k/v share a quant type and gate/up do, as in SmolLM2;
at most 12)::

    h  = RMSNorm(x; attn_norm)            (fused with the previous residual add)
    q, k, v = Wq h, Wk h, Wv h             (into one q | k | v row; one matmul per run of
                                            neighbours of one type, stacked into one pack)
    qk_rope: biases, QK-norm, RoPE; K/V into the cache
    attention (causal GQA, sliding window where the layer has one)
    a  = Wo o
    x += a (Gemma: RMSNorm(a; post_attention_norm)); h = RMSNorm(x; ffn_norm)
    g, u = Wgate h, Wup h (stacked likewise);  act = silu(g)·u (Gemma: gelu_tanh(g)·u);  f = Wdown act
    x += f (Gemma: RMSNorm(f; post_ffw_norm)), fused with the next layer's norm

The rows' other rules change a few steps: smollm3's NoPE layers skip RoPE, granite scales the
embedding, each residual branch and the logits, olmo2 has post-norms only (the sublayers read x),
gemma2 soft-caps the scores and the logits. An lfm2 short-convolution layer runs in_proj [b | c |
x], short_conv (c ⊙ conv(b ⊙ x) over its ring of b·x rows) and out_proj where others attend.

MoE layers (qwen3moe, olmoe; 14 dispatches) replace the FFN's four: router logits = Wgate_inp h;
routes (top-k expert ids and weights, on the GPU); g, u = the routed experts' Wgate_e h, Wup_e h
(only the selected experts' rows, ids read from the routes buffer); act; f = Σ_j w_j Wdown_e act_j.
Nothing of the routing is read back: a decode step stays one submit.

then the final norm, the head over the rows that are needed and the sampler.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..chat.dense import DenseChat
from ..chat.template import ChatTemplate
from ..constants import f32
from ..errors import ContextFullError, InputError, UnsupportedModelError
from ..formats.dense_geometry import DenseGeometry
from ..formats.gguf import MAGIC, GgufFile, open_gguf
from ..formats.gguf_tokenizer import tokenizer_from_gguf
from ..gpu.device import Binding, Device, Plan, UniformArena
from ..gpu.sizing import WEBGPU_DEFAULT_LIMITS, SizingDevice
from ..kernels import attention as attention_ops
from ..kernels import conv as conv_ops
from ..kernels import moe as moe_ops
from ..kernels import qmatmul
from ..kernels import sample as sample_ops
from ..pooling import Pool, file_pooling, rows_needed
from .dense_batch import DenseBatch
from .dense_layers import build_layers, embedding_scale, head, qkv_width
from .protocols import Capabilities
from .session import ChunkedSession, PlanKey, clamp_context, session_ids

PREFILL_CHUNK = 64
KV_MODES = ("f32", "f16")  # f16: IEEE halves packed in words (core WGSL, no shader-f16 needed)
DEFAULT_CONTEXT = 4096  # a session's KV cache unless a longer one is asked for (the file may allow 128k)
F32 = 4
ALIGN = 64  # floats: every vector in the norms buffer starts on a 256-byte boundary
MOE_FFN = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def sniff(head: bytes) -> bool:
    return bytes(head[:4]) == MAGIC


@dataclass(frozen=True)
class DenseFile:
    """A validated GGUF file and the dense geometry read from it."""

    gguf: GgufFile
    geometry: DenseGeometry


def read(source) -> DenseFile:
    """Read and validate a GGUF file (path or bytes) and its dense geometry (no GPU)."""
    f = open_gguf(source)
    return DenseFile(f, DenseGeometry.from_gguf(f))


NUMERICS = ("float",)  # no deploy numerics: those are Needle 3's (§4.9 of the Needle 3 spec)


NAME = "dense"
LADDER = False  # no elastic depth: families.py refuses a depth before anything is read


def open(parsed: DenseFile, device: Device, progress=None, numerics="float", depth=None) -> "DenseGpu":
    """Upload a validated file (``families.open_gpu_model`` has checked ``numerics`` and ``depth``
    against ``NUMERICS`` and ``LADDER``)."""
    return DenseGpu(device, parsed, progress=progress)


def describe(parsed: DenseFile, context: int | None = None, depth=None) -> dict:
    """Architecture, geometry, quantisation mix and GPU bytes for a context, without a GPU."""
    f, g = parsed.gguf, parsed.geometry
    mix: dict = {}
    for name, _ in g.tensors():
        t = f[name]
        mix[t.type.name] = mix.get(t.type.name, 0) + t.nbytes
    context = default_context(g) if context is None else clamp_context(context, g.max_seq_len)
    weights = sum(f[name].nbytes for name, _ in g.tensors())
    experts = ({"count": g.num_experts, "used": g.num_experts_used, "width": g.ff_dim,
                "renormalised": g.rules.renormalise} if g.is_moe else None)
    return {"family": "dense", "architecture": g.arch,
            "geometry": {k: getattr(g, k) for k in g.__dataclass_fields__}, "experts": experts,
            "tensor_bytes": weights, "file_bytes": f.file_size, "quant_bytes": mix,
            "context": context, "kv_bytes": {mode: kv_bytes(g, context, mode) for mode in KV_MODES},
            "gpu_bytes": {mode: gpu_bytes(parsed, context, mode) for mode in KV_MODES},
            "tokenizer": f.get_str("tokenizer.ggml.model", None),
            "chat_template": ChatTemplate(f.get_str("tokenizer.chat_template", None)).describe()}


def file_warnings(parsed: DenseFile) -> list:
    """What the file says that the graph does not do, as llama.cpp does not either: a sliding
    window declared by an architecture without sliding layers (Mistral-style llama files;
    llama.cpp's llama graph attends to the whole past whatever attention.sliding_window says)."""
    g = parsed.geometry
    if not g.declared_window:
        return []
    return [f"metadata key '{g.arch}.attention.sliding_window' ({g.declared_window}) is not applied: every layer "
            f"attends to the whole context, as llama.cpp's {g.arch} graph does"]


def gpu_bytes(parsed: DenseFile, context: int, kv: str = "f32", limits=WEBGPU_DEFAULT_LIMITS) -> dict:
    """What loading the file and opening one session of ``context`` positions take on a device
    with ``limits`` (WebGPU's defaults: 128 MiB bindings), by kind, before anything loads: the
    weights in the file's bits (row-split as ``qmatmul.upload`` splits them; stacked neighbours
    and their parts round differently, by a few 16-byte paddings a tensor) and the session's buffers, counted by opening it on a
    ``SizingDevice``."""
    f, g = parsed.gguf, parsed.geometry
    weights, vectors = 0, set(g.vector_tensors())
    for name, ne in g.tensors():
        t = f[name]
        if name in vectors:
            weights += -(-t.nbytes // (F32 * ALIGN)) * F32 * ALIGN  # the vectors buffer
        else:
            weights += qmatmul.packed_bytes(name, t.type.name, t.rows, t.row_width, limits.max_storage_binding)
    sizing = SizingDevice(limits)
    DenseSession(_SizedModel(g, sizing), context=context, kv=kv)
    session = sizing.counters.bytes_allocated
    out = {"weights": weights, "kv": session.get("kv", 0), "scratch": session.get("scratch", 0) + session.get("session", 0)}
    return out | {"total": sum(out.values())}


@dataclass(frozen=True)
class _SizedModel:
    """What a session reads of its model when it opens (``gpu_bytes``)."""

    geometry: DenseGeometry
    device: Device


def default_context(g: DenseGeometry) -> int:
    return min(g.max_seq_len, DEFAULT_CONTEXT)


def kv_bytes(g: DenseGeometry, context: int, mode: str = "f32") -> int:
    """K and V for every layer at ``context`` positions (sliding layers keep a ring; lfm2's
    convolution blocks only their ring of recent b·x rows, always f32)."""
    total = 0
    for layer in range(g.num_layers):
        if g.is_conv(layer):
            total += F32 * conv_ops.ring_slots(PREFILL_CHUNK, g.conv_taps) * g.d_model * (2 if mode == "f16" else 1)
            continue
        shape = attention_shape(g, layer)
        slots = context if shape.window is None else min(shape.window + PREFILL_CHUNK - 1, context)
        total += F32 * slots * g.num_kv_heads * (g.key_dim + g.value_dim)
    return total // 2 if mode == "f16" else total


def attention_shape(g: DenseGeometry, layer: int, context: int | None = None) -> attention_ops.AttentionShape:
    """One layer's attention for a session of ``context`` positions (LongRoPE's factors depend
    on it; None: the default context)."""
    base, scale = g.rope(layer)
    table, magnitude = g.rope_variant(layer, default_context(g) if context is None else context)
    rope = ("neox" if g.rope_neox else "adjacent") if g.has_rope(layer) else "none"
    if rope == "none":
        table, magnitude = None, 1.0
    return attention_ops.AttentionShape(
        heads=g.num_heads, kv_heads=g.num_kv_heads, qk_dim=g.key_dim, v_dim=g.value_dim,
        window=None if g.is_global(layer) else g.sliding_window, rope=rope,
        rotary_dims=g.rope_dims, rope_base=base, rope_scale=scale, rope_table=table, rope_mscale=magnitude,
        scale=f32(g.attention_scale),
        norm=g.qk_norm or "none", eps=g.rms_eps,
        bias=g.qkv_bias, softcap=g.attn_softcap)


class _Vectors:
    """Every F32 vector of the graph (norm weights, biases) in one buffer, by float offset."""

    def __init__(self, f: GgufFile, names: list):
        self.at, parts, size = {}, [], 0
        for name in names:
            data = f[name].data
            self.at[name] = size
            padded = -(-len(data) // (F32 * ALIGN)) * F32 * ALIGN
            parts.append(bytes(data) + bytes(padded - len(data)))
            size += padded // F32
        self.data = b"".join(parts)


class DenseGpu:
    """A dense GGUF model's weights on a device, in the file's quantised bits (spec §4.3)."""

    def __init__(self, device: Device, parsed: DenseFile, progress=None):
        self.device, self.parsed, self.file = device, parsed, parsed.gguf
        self.geometry = g = parsed.geometry
        f = self.file
        report = progress or (lambda stage, done, total: None)
        metadata = f.metadata()
        self.tokenizer = tokenizer_from_gguf(metadata)
        template = metadata.get("tokenizer.chat_template")
        self.chat = DenseChat(self.tokenizer, template if isinstance(template, str) else None)
        self.pooling = file_pooling(f, g.arch)  # embeddings: the final hidden states pooled (pooling.py)
        self.shapes = [attention_shape(g, layer) for layer in range(g.num_layers)]
        for shape in self.shapes:
            shape.check()
        for name in MOE_FFN[1:] if g.is_moe else ():  # every layer's experts have layer 0's size
            moe_ops.check_expert_bytes(name, f[f"blk.0.{name}.weight"].nbytes, device.limits.max_storage_binding)
        weights_before = device.counters.bytes_allocated.get("weights", 0)
        self.vectors = _Vectors(f, g.vector_tensors())
        self.vector_buffer = device.buffer(len(self.vectors.data), label="vectors", data=self.vectors.data,
                                           kind="weights")
        self.embedding = self._upload("token_embd.weight")
        self.head = self.embedding if g.tied_head else self._upload("output.weight")
        self.layers = []
        for i in range(g.num_layers):
            report("upload", i, g.num_layers)
            names = lambda *parts: [f"blk.{i}.{part}.weight" for part in parts]
            # fused files (phi3) hold q | k | v and gate | up in one tensor: the same rows stacked
            qkv = names("attn_qkv") if g.rules.fused_qkv else names("attn_q", "attn_k", "attn_v")
            if g.is_conv(i):  # lfm2: in_proj [b | c | x] and out_proj in the places of qkv and attn_output
                weights = {"qkv": self._upload_stacked(names("shortconv.in_proj")),
                           "out": self._upload(f"blk.{i}.shortconv.out_proj.weight")}
            else:
                weights = {"qkv": self._upload_stacked(qkv), "out": self._upload(f"blk.{i}.attn_output.weight")}
            if g.is_moe:
                weights.update({name: self._upload(f"blk.{i}.{name}.weight") for name in MOE_FFN})
            else:
                gate_up = names("ffn_up") if g.rules.fused_gate_up else names("ffn_gate", "ffn_up")
                weights.update(gate_up=self._upload_stacked(gate_up),
                               down=self._upload(f"blk.{i}.ffn_down.weight"))
            self.layers.append(weights)
        self.weight_bytes = device.counters.bytes_allocated.get("weights", 0) - weights_before
        report("upload", g.num_layers, g.num_layers)

    def _upload(self, name: str) -> qmatmul.QPack:
        t = self.file[name]
        return qmatmul.upload(self.device, name, t.type.name, t.data, rows=t.rows, cols=t.row_width)

    def _upload_stacked(self, names: list) -> list:
        """Matrices that read the same input and write consecutive parts of one output row
        (q | k | v, gate | up), as [(pack, first output row)]: neighbours of one type are
        stacked into one pack (GGUF rows are row-major, so the bytes simply follow each other),
        so the step runs one matmul for them instead of one each."""
        groups, at = [], 0
        for name in names:
            t = self.file[name]
            if groups and (groups[-1][0].type, groups[-1][0].row_width) == (t.type, t.row_width):
                groups[-1][1].append(t)
            else:
                groups.append((t, [t], at))
            at += t.rows
        out = []
        for first, tensors, row in groups:
            data = first.data if len(tensors) == 1 else b"".join(bytes(t.data) for t in tensors)
            label = "+".join(t.name for t in tensors)
            pack = qmatmul.upload(self.device, label, first.type.name, data, rows=sum(t.rows for t in tensors),
                                  cols=first.row_width)
            out.append((pack, row))
        return out

    def vector(self, name: str) -> int:
        return self.vectors.at[name]

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(numerics=NUMERICS, mask=DenseSession.supports_mask, verify=DenseSession.supports_verify,
                            batch=not self.geometry.conv_layers,
                            pooling=self.pooling)

    @property
    def name(self) -> str:
        """The file's ``general.name``, else the family's name."""
        try:
            return self.file.get_str("general.name", None) or "needle-wgpu-dense"
        except Exception:  # a name of the wrong type: unnamed
            return "needle-wgpu-dense"

    @property
    def warnings(self) -> list:
        return file_warnings(self.parsed)

    def describe(self) -> dict:
        return describe(self.parsed) | {"gpu_weight_bytes": self.weight_bytes}

    def batch(self, capacity: int) -> DenseBatch:
        """Scratch and plans for decode steps of up to ``capacity`` of this model's sessions at
        once (``models.batch.DecodeBatch``)."""
        return DenseBatch(self, capacity)

    def session(self, context=None, kv="f32") -> "DenseSession":
        return DenseSession(self, context=context, kv=kv)


class DenseSession(ChunkedSession):
    """One conversation: f32 K/V caches and scratch rows for a fixed context, cached plans."""

    supports_mask = True  # the sampler reads self.mask when the plan key says so

    def __init__(self, model: DenseGpu, context=None, kv="f32"):
        g = model.geometry
        self.model = model
        self._open(model.device, default_context(g) if context is None else context, g.max_seq_len)
        self.shapes = [attention_shape(g, layer, self.context) for layer in range(g.num_layers)]
        # a ring forgets keys (sliding layers) and b·x rows (lfm2's convolution blocks)
        self.rewindable = all(shape.window is None for shape in self.shapes) and not g.conv_layers
        mode = "f32" if kv is None else str(kv).lower()
        if mode not in KV_MODES:
            raise UnsupportedModelError(f"kv={kv!r}: dense models keep an f32 or f16 KV cache")
        dev = self.device
        self.logit_rows = g.head_rows
        qkv = qkv_width(g)
        routed = max(1, g.num_experts_used)  # MoE: each position's gate | up rows per selected expert
        widest = F32 * max(g.head_rows, qkv, 2 * g.ff_dim * routed, g.d_model)
        self.chunk = T = max(1, min(PREFILL_CHUNK, self.context, dev.limits.max_storage_binding // widest))
        s = lambda width, label: dev.buffer(F32 * T * width, label=label, kind="scratch")
        self.x = s(g.d_model, "residual")
        self.h = s(g.d_model, "normed")
        self.qkv = s(qkv, "qkv")
        self.q = s(g.q_dim, "q")
        self.o = s(max(g.attn_out, g.d_model if g.conv_layers else 0), "attention")  # lfm2: the gated conv
        self.o_stride = g.attn_out  # floats per attention-output row (a convolution block's rows: d_model)
        self.branch = s(g.d_model, "branch")  # Wo and Wdown outputs before the residual add
        self.gate_up = s(2 * g.ff_dim * routed, "gate_up")
        self.act = s(g.ff_dim * routed, "act")
        if g.is_moe:
            self.router_logits = s(g.num_experts, "router_logits")
            self.routes = dev.buffer(moe_ops.routes_bytes(T, routed), label="routes", kind="scratch")
        self.logits = s(g.head_rows, "logits")
        self.caches = [None if g.is_conv(i) else
                       attention_ops.KvCache(dev, shape, self.context, chunk=T, name=f"kv_cache.{i}", mode=mode)
                       for i, shape in enumerate(self.shapes)]
        attending = [i for i in range(g.num_layers) if not g.is_conv(i)]
        self.partials = attention_ops.attention_partials(dev, [self.shapes[i] for i in attending],
                                                         [self.caches[i] for i in attending], T)
        self.conv_slots = conv_ops.ring_slots(T, g.conv_taps) if g.conv_layers else 0
        self.conv_rings = {i: dev.buffer(F32 * self.conv_slots * g.d_model, label=f"conv_ring.{i}", kind="kv")
                           for i in g.conv_layers}  # lfm2: each block's b·x rows by position (its state)

    def embedding(self, ids: list) -> list:
        """The model's pooling of the final hidden states (after the output norm) over ``ids``,
        L2-normalised (``pooling.py``, as llama.cpp's embeddings): chunks run without a sampler,
        and the rows the pooling needs are read back after each."""
        self._check()
        ids = session_ids(ids)
        if not ids:
            raise InputError("an embedding needs at least one token")
        if self.position + len(ids) > self.context:
            raise ContextFullError(f"embedding: {len(ids)} ids, more than the context of {self.context}")
        d = self.model.geometry.d_model
        pool, needed = Pool(self.model.pooling, d), rows_needed(self.model.pooling, len(ids))
        length = min(self.chunk, self.device.prefill_chunk or self.chunk)
        for start in range(0, len(ids), length):
            part = ids[start : start + length]
            self._run_chunk(part, None)
            rows = [r - start for r in needed if start <= r < start + len(part)]
            if rows:
                first, count = rows[0], rows[-1] - rows[0] + 1
                data = struct.unpack(f"<{count * d}f", self.device.read(self.h, 4 * count * d, 4 * first * d))
                for r in range(count):
                    pool.add(data[r * d : (r + 1) * d])
        return pool.vector()

    def _build(self, key: PlanKey) -> Plan:
        m, g, dev = self.model, self.model.geometry, self.device
        T = key.positions
        arena = UniformArena(dev, capacity=max(1 << 14, 4096 * (g.num_layers + 2) * 16), label=f"uniforms.T{T}")
        plan = Plan(dev, f"dense chunk T={T}")
        step = Binding(self.step_uniform)
        vec = m.vector_buffer
        qmatmul.get_rows(plan, arena, m.embedding, self.tokens, self.x, step=step, positions=T,
                         scale=embedding_scale(g))
        stride = qkv_width(g)

        def attend(plan: Plan, arena: UniformArena, layer: int, vectors: dict) -> None:
            if g.is_conv(layer):  # lfm2: o = c ⊙ conv(b ⊙ x) over the block's ring
                conv_ops.short_conv(plan, arena, step, bcx=self.qkv, weights=vec, ring=self.conv_rings[layer],
                                    y=self.o, width=g.d_model, taps=g.conv_taps, positions=T, slots=self.conv_slots,
                                    weight_at=m.vector(f"blk.{layer}.shortconv.conv.weight"), bcx_stride=stride,
                                    label=f"short_conv {layer}")
                return
            shape = self.shapes[layer]
            attention_ops.qk_rope(plan, arena, step, shape=shape, qkv=self.qkv, q_out=self.q,
                                  cache=self.caches[layer], positions=T, vectors=vec if vectors else None,
                                  qkv_stride=stride, label=f"qk_rope {layer}", **vectors)
            attention_ops.attention(plan, arena, step, shape=shape, q=self.q, cache=self.caches[layer], o=self.o,
                                    positions=T, partials=self.partials, label=f"attention {layer}")

        scored = T if key.all_logits else 1
        build_layers(plan, arena, m, self, T, attend, gemm=None)
        head(plan, arena, m, self, T, scored)
        if key.sample is not None:
            sample_ops.sample(plan, arena, step, logits=self.logits, logits_offset=(scored - 1) * g.head_rows,
                              rows=g.head_rows, tokens=self.tokens, result=self.result, context=self.context,
                              positions=T, sampling=key.sample, mask=self.mask if key.mask else None)
        return plan
