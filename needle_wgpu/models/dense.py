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

from dataclasses import dataclass

from ..chat.dense import DenseChat
from ..chat.template import ChatTemplate
from ..formats.dense_geometry import DenseGeometry
from ..formats.gguf import MAGIC, GgufFile, open_gguf
from ..formats.gguf_tokenizer import tokenizer_from_gguf
from ..gpu.device import Device
from ..gpu.sizing import WEBGPU_DEFAULT_LIMITS, SizingDevice
from ..kernels import moe as moe_ops
from ..kernels import qmatmul
from ..pooling import file_pooling
from .dense_batch import DenseBatch
from .dense_session import F32, KV_MODES, DenseSession, attention_shape, default_context, kv_bytes
from .protocols import Capabilities
from .session import clamp_context

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


def gpu_bytes(parsed: DenseFile, context: int, kv: str = "f32", limits=WEBGPU_DEFAULT_LIMITS,
              software_rasterizer: bool = False) -> dict:
    """What loading the file and opening one session of ``context`` positions take on a device
    with ``limits`` (WebGPU's defaults: 128 MiB bindings), a GPU unless ``software_rasterizer``
    (a CPU adapter attends in ranges of 512 slots, a GPU in ranges of 256: their partials), by kind, before anything loads: the
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
    sizing = SizingDevice(limits, software_rasterizer)
    DenseSession(_SizedModel(g, sizing), context=context, kv=kv)
    session = sizing.counters.bytes_allocated
    out = {"weights": weights, "kv": session.get("kv", 0), "scratch": session.get("scratch", 0) + session.get("session", 0)}
    return out | {"total": sum(out.values())}


@dataclass(frozen=True)
class _SizedModel:
    """What a session reads of its model when it opens (``gpu_bytes``)."""

    geometry: DenseGeometry
    device: Device


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

    def session(self, context=None, kv="f32", slabs=None) -> "DenseSession":
        """``slabs``: a batch's (``DecodeBatch.slab_for``), for the sessions it makes."""
        return DenseSession(self, context=context, kv=kv, slabs=slabs)
