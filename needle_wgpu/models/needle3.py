"""Needle 3 on the GPU: weights uploaded once, sessions with a preallocated cache, and the
prebuilt dispatch plans of docs/gpu-layout.md, read top to bottom as the model's forward (§4).
"""

from __future__ import annotations

import copy

from . import needle3_numerics as numerics_rules
from ..constants import kv_cq_levels
from ..errors import InputError, NeedleError, NonFiniteWeightsError, UnsupportedModelError
from ..formats import cact
from ..formats.cact import CactFile
from ..formats.needle3_tokenizer import Tokenizer
from ..gpu.device import Binding, Device, Plan, UniformArena
from ..inputs import checked_methods, flag
from ..kernels import attention as attention_ops
from ..kernels import cq
from ..kernels.needle3 import embed as embed_ops, mhc as mhc_ops, mlp as mlp_ops
from ..kernels.needle3 import probe as probe_ops
from ..kernels import sample as sample_ops
from ..kernels.needle3.fp16_store import Fp16Store, permutation_words
from ..chat.needle3 import Needle3Chat
from .needle3_batch import Needle3Batch
from .needle3_layers import build_blocks, build_engram, build_head
from .needle3_support import _pad, check_supported, widest_row_bytes
from .ladder import Rung, full_rung, rung
from .protocols import Capabilities
from .session import ChunkedSession, PlanKey, session_ids

PREFILL_CHUNK = 64
F32 = 4
NUMERICS = numerics_rules.NUMERICS  # float (§4.1-§4.8) and deploy (§4.9)
MAGICS = (cact.TAG_V3.to_bytes(4, "little"), cact.TAG_V2.to_bytes(4, "little"))


def sniff(head: bytes) -> bool:
    """A .cact container (v3, or v2, which the reader refuses by name)."""
    return bytes(head[:4]) in MAGICS


NAME = "needle3"
LADDER = True  # elastic depth (§10): rungs over the same weights


def check_depth(container: CactFile, depth) -> None:
    """Refuse a depth the file's ladder cannot give (``DepthError``), before any upload."""
    rung(container.geometry, depth)


def read(source) -> CactFile:
    """Read and validate a .cact file (path or bytes)."""
    return cact.load(source)


def open(container: CactFile, device: Device, progress=None, numerics="float", depth=None) -> "Needle3Gpu":
    """Upload a validated container to ``device``, to run ``numerics`` ("float" or "deploy");
    ``depth`` (None: the file's own) runs that rung of the ladder (§10, §U f) over the uploaded
    weights (``Needle3Gpu.at_depth``; ``families`` has refused a depth the file cannot give)."""
    model = Needle3Gpu(device, container, progress=progress, numerics=numerics)
    return model if depth is None else model.at_depth(depth)


def describe(container: CactFile, context=None, depth=None) -> dict:
    """A .cact file's geometry and layout, without a GPU (``needle-wgpu info``; sessions are
    sized by the model's own context, so ``context`` changes nothing here). ``depth``: the
    rung it would run at (§10): ``geometry`` is then the rung's, with the stored ``blocks``."""
    g = container.geometry
    r = full_rung(g) if depth is None else rung(g, depth)
    out = {"family": "needle3", "geometry": {k: getattr(r.geometry, k) for k in g.__dataclass_fields__},
           "depth": r.depth,
           "records": len(container.tensors) + (1 if container.tokenizer is not None else 0),
           "tensor_bytes": container.tensor_bytes, "file_bytes": container.file_size,
           "heads": list(container.head_codes),
           "tokenizer_bytes": len(container.tokenizer) if container.tokenizer is not None else 0,
           "warnings": container.warnings}
    if not r.full:
        out |= {"file_layers": g.num_layers, "blocks": list(r.blocks)}
    return out


@checked_methods
class Needle3Gpu:
    """The model's weights on a device, in quantised form (no dequantised copies).

    ``numerics`` "deploy" runs upstream's quant=True forward (§4.9): A8 fused into the kernels
    that prepare each CQ product's input, q A8 per head, K/V by the session's KV mode (default:
    the header's kv_bits, §U d). The header's kv_window is reported, never applied (§U e).
    """

    def __init__(self, device: Device, container: CactFile, progress=None, numerics="float"):
        self.numerics = numerics_rules.choice(numerics)
        self.deploy = self.numerics == "deploy"
        check_supported(container, device.limits)
        if self.deploy:  # the header's KV mode must be one this engine runs (§U d)
            default_kv = numerics_rules.header_kv_mode(container.geometry.kv_bits)
            if numerics_rules.cq_bits(default_kv):
                for layer in range(container.geometry.num_layers):
                    attention_ops.check_kv_cq(attention_ops.needle3_shape(container.geometry, layer), (0.0,) * 16)
        self.device = device
        self.cact = container
        self.geometry = g = container.geometry
        self.tokenizer = Tokenizer.from_blob(container.tokenizer) if container.tokenizer is not None else None
        self.chat = Needle3Chat()
        weights_before = device.counters.bytes_allocated.get("weights", 0)
        self.report = report = progress or (lambda stage, done, total: None)
        self.group = container["embedding"].group
        self.levels = device.buffer(cq.LEVELS_BYTES, label="levels", data=cq.levels_bytes(container), kind="weights")
        self.fp16 = Fp16Store(device, container)
        self.perm = device.buffer(8 * g.hada_n, label="perm", data=permutation_words(container), kind="weights")
        self.hada_shape = mlp_ops.HadaShape.from_cact(container)
        self.hada_shape.check()
        self.embedding = cq.upload_pack(device, "embedding", [container["embedding"]])
        self.layers = []
        for i in range(g.num_layers):
            report("upload", i, g.num_layers)
            qkvg = [container.layer(i, n) for n in ("q_proj", "k_proj", "v_proj", "gate_proj")]
            self.layers.append({
                "qkvg": cq.upload_pack(device, f"layers.{i}.qkvg", qkvg),
                "out": cq.upload_pack(device, f"layers.{i}.out", [container.layer(i, "out_proj")]),
            })
        n = g.mhc_lanes
        band = []
        for i in range(g.num_layers):  # layer-major so one layer's 24 rows are one band (§4.4, §4.7)
            band += [(container["mhc.phi_pre"], i * n, (i + 1) * n),
                     (container["mhc.phi_post"], i * n, (i + 1) * n),
                     (container["mhc.phi_res"], i * n * n, (i + 1) * n * n)]
        self.mhc = cq.upload_pack(device, "mhc", band)
        sites = range(len(g.engram_sites))
        self.engram_kv = None  # a model without Engram has no sites (§U c)
        if sites:
            self.engram_kv = cq.upload_pack(
                device, "engram.kv", [container[f"engram.{s}.{p}"] for s in sites for p in ("key_proj", "value_proj")])
        self.engram_tables = [cq.upload_pack(device, f"engram.{s}.tables", [container[f"engram.{s}.tables"]])
                              for s in sites]
        # Probe heads by manifest code (§U a), each with its own probe rows on the GPU.
        self.heads = {code: probe_ops.ProbeHead(container, h) for h, code in enumerate(container.head_codes)}
        self.head_probes = {code: cq.upload_pack(device, f"heads.{head.prefix}probes", [head.probes])
                            for code, head in self.heads.items()}
        self.confidence = self.heads.get(probe_ops.CONFIDENCE)
        self.weight_bytes = device.counters.bytes_allocated.get("weights", 0) - weights_before
        # Elastic depth (§10): which stored layers run as blocks 0 … D − 1 (all of them here).
        self.stored_geometry = g
        self.rung: Rung = full_rung(g)
        self.full = self
        report("upload", g.num_layers, g.num_layers)

    def at_depth(self, depth) -> "Needle3Gpu":
        """The depth-``depth`` rung of this full-depth model (§U f) over the same GPU weights:
        the rung's blocks bind the full model's weight buffers (φ bands, FP16 windows, probe
        rows at their stored offsets), so nothing is uploaded or copied. ``DepthError`` for a
        depth the file cannot give."""
        full = self.full
        r = rung(full.stored_geometry, depth)
        if r.full:
            return full
        view = copy.copy(full)
        view.rung, view.geometry = r, r.geometry
        view.layers = [full.layers[b] for b in r.blocks]
        view.heads = {code: head.at_cells(r.cells) for code, head in full.heads.items()}
        view.confidence = view.heads.get(probe_ops.CONFIDENCE)
        return view

    @property
    def capabilities(self) -> Capabilities:
        """What this file (at this rung) can do: its probe heads, the ladder, both numerics."""
        confidence = self.confidence is not None and self.confidence.host_work <= probe_ops.MAX_HOST_WORK
        return Capabilities(heads=frozenset(self.heads), confidence=confidence, depth_ladder=True,
                            numerics=NUMERICS, mask=Needle3Session.supports_mask,
                            verify=Needle3Session.supports_verify, batch=True)

    @property
    def name(self) -> str:
        return "needle-wgpu-needle3"

    @property
    def mix_width(self) -> int:
        n = self.geometry.mhc_lanes
        return 2 * n + n * n

    def describe(self) -> dict:
        """The file's description, the GPU weight bytes, the numerics and KV mode, and the
        depth it runs at (with the stored layers a rung runs; ``geometry`` is then the rung's)."""
        g = self.geometry
        depth = None if self.rung.full else self.rung.depth
        default_kv = numerics_rules.kv_mode(None, self.numerics, g.kv_bits)
        return describe(self.cact, depth=depth) | {"gpu_weight_bytes": self.weight_bytes, "numerics": self.numerics,
                                                   "kv_default": default_kv, "kv_window": g.kv_window}

    def kv_levels(self, mode: str) -> tuple:
        """The CQ K/V levels at group 64 of a KV mode ("cq2"…"cq4"), () for the others (§4.9 point 5)."""
        bits = numerics_rules.cq_bits(mode)
        return kv_cq_levels(self.cact.levels(bits), self.group) if bits else ()

    @property
    def warnings(self) -> list:
        """Problems of a file that loaded (non-finite weights); requests refuse to run with any."""
        return self.cact.warnings

    def session(self, context=None, kv=None, confidence=False, heads=(), pad_masked=False,
                slabs=None) -> "Needle3Session":
        """A session; ``confidence`` (or ``heads``, manifest codes) runs those probe heads'
        pools alongside every chunk of prefill and decode (§7). ``kv``: None (float numerics:
        "f32"; deploy: the header's kv_bits), "f32" or "int8", and under deploy numerics also
        "cq2", "cq3", "cq4" (``needle_wgpu.models.needle3_numerics.kv_mode``). ``pad_masked``: every
        pad-dependent term is masked as in upstream's hidden cells (§U a), for the heads' pass.
        ``slabs``: a batch's (``DecodeBatch.slab_for``), for the plain sessions it makes."""
        if self.cact.nonfinite:
            raise NonFiniteWeightsError(f"this model cannot serve requests: {self.cact.warnings[0]}")
        return Needle3Session(self, context=context, kv=kv, confidence=confidence, heads=heads,
                              pad_masked=pad_masked, slabs=slabs)

    def batch(self, capacity: int) -> "Needle3Batch":
        """Scratch and plans for decode steps of up to ``capacity`` of this model's plain sessions
        at once (``models.batch.DecodeBatch``)."""
        return Needle3Batch(self, capacity)


@checked_methods
class Needle3Session(ChunkedSession):
    """One conversation: the KV cache and scratch for a fixed context, and cached plans.

    The context is fixed at creation (default: the model's max_seq_len), so every buffer and
    bind group is built once. Decode is one submit; its only readback is the sampled id.
    """

    supports_mask = True  # the sampler reads self.mask when the plan key says so
    supports_verify = True  # PlanKey.every_position: a sampler after every position

    def __init__(self, model: Needle3Gpu, context=None, kv=None, confidence=False, heads=(), pad_masked=False,
                 slabs=None):
        g = model.geometry
        self.model = model
        self.kv_mode = numerics_rules.kv_mode(kv, model.numerics, g.kv_bits)
        self.kv_levels = model.kv_levels(self.kv_mode)
        for layer in range(g.num_layers):
            attention_ops.check_kv_cq(attention_ops.needle3_shape(g, layer), self.kv_levels)
        self._open(model.device, context, g.max_seq_len)
        # upstream's hidden cells (§U a): attention keys, conv taps and engram n-grams at the pad id 0 masked
        self.pad_masked = flag(pad_masked, "pad_masked")
        self.logit_rows = g.head_rows
        self.int8 = self.kv_mode == "int8"
        dev = self.device
        G = model.group
        sites = len(g.engram_sites)  # a rung's: only its kept sites run (§U f)
        # A prefill chunk is as long as the widest per-position scratch row allows under the
        # device's binding limit (64 on any real device).
        widest = widest_row_bytes(g, G)
        self.chunk = T = max(1, min(PREFILL_CHUNK, self.context, dev.limits.max_storage_binding // widest))
        self.ring = 1 << (T + max(g.qkv_conv_taps, 1) - 1 + (g.engram_conv_taps - 1) * g.engram_conv_dilation).bit_length()
        s = lambda width, label: dev.buffer(F32 * T * width, label=label, kind="scratch")
        self.lanes = s(g.mhc_lanes * g.d_model, "lanes")
        self.nxh = s(_pad(g.mhc_width, G), "nxh")
        self.mix = s(model.mix_width, "mix")
        self.state = mhc_ops.mhc_state(dev, T, g.d_model, g.mhc_lanes)
        self.hh = s(_pad(g.d_model, G), "hh")
        self.qkvg = s(g.q_dim + g.k_dim + g.v_dim + g.attn_out, "qkvg")
        self.q = s(g.q_dim, "q")
        self.o = s(g.attn_out, "o")
        self.qkvg_stride, self.o_stride = g.q_dim + g.k_dim + g.v_dim + g.attn_out, g.attn_out  # floats a row
        self.oh = s(_pad(g.attn_out, G), "oh")
        self.a = s(g.d_model, "a")
        self.xfh = s(_pad(g.d_model, G), "xfh")
        self.logits = s(g.head_rows, "logits")
        self.eh_width = _pad(g.engram_width, G)  # a fetched row, tables·sub_dim padded (§U c)
        self.eh = s(max(1, sites * self.eh_width), "eh")
        self.ekv = s(max(1, sites * 2 * g.d_model), "ekv")
        self.ev = s(max(1, sites * g.d_model), "ev")
        self.engram_ring = dev.buffer(F32 * max(1, sites * self.ring * g.d_model), label="engram_ring",
                                      kind="session")
        self.qkv_rings = [dev.buffer(F32 * self.ring * (g.q_dim + g.k_dim + g.v_dim), label=f"qkv_ring.{i}",
                                     kind="kv") for i in range(g.num_layers)]
        self.cells = None
        codes = list(heads_requested(heads))
        if flag(confidence, "confidence") and probe_ops.CONFIDENCE not in codes:
            codes.append(probe_ops.CONFIDENCE)
        self.pools = {}  # manifest code -> (scores, pool state) of each head this session runs
        if codes:
            # Hidden cells and the §7 probe pools: only sessions that run heads pay for them.
            for code in codes:
                if code not in model.heads:
                    raise UnsupportedModelError(
                        f"this model file has no {probe_ops.HEAD_NAMES.get(code, code)} head (§7)")
                model.heads[code].check()
            C = g.num_layers + 1
            self.cells = dev.buffer(F32 * T * C * g.d_model, label="cells", kind="scratch")
            self.cellsh = dev.buffer(F32 * T * C * _pad(g.d_model, G), label="cellsh", kind="scratch")
            for code in codes:
                rows = model.heads[code].probe_rows
                scores = dev.buffer(F32 * T * rows, label=f"scores.{code}", kind="scratch")
                state = dev.buffer(F32 * rows * (g.d_model + 2), label=f"probe_pool.{code}", kind="session",
                                   data=probe_ops.pool_reset_bytes(rows, g.d_model))
                self.pools[code] = (scores, state)
        shapes = [attention_ops.needle3_shape(g, i) for i in range(g.num_layers)]
        # a batch's plain session (no heads, no pad mask) keeps its caches in the batch's slab
        plain = not self.pools and not self.pad_masked
        slab = slabs(shapes, self.context, T, "int8" if self.int8 else "f32") if slabs is not None and plain else None
        if slab is None:
            self.caches = [attention_ops.KvCache(dev, shape, self.context, self.int8, chunk=T, name=f"kv_cache.{i}")
                           for i, shape in enumerate(shapes)]
        self.partials = attention_ops.attention_partials(dev, shapes, self.caches if slab is None else slab.layouts, T)
        # Stepping back over the last T positions is exact: a local layer's ring holds T − 1
        # slots beyond its window and the conv rings more than T + their taps, so the positions
        # a rewound chunk reads again were never overwritten. The probe pools cannot un-fold.
        self.max_rewind = 0 if self.pools else T
        self.restartable = not self.pools
        if slab is not None:  # its rows attend with the batch's
            self.caches = self._take_slot(slab)

    @property
    def past_kv_window(self) -> bool:
        """True once this session holds more positions than the header's kv_window (§U e): the
        engine's attention stays exact up to max_seq_len, never windowed, so from here on it
        may differ from a native engine that applies the trained window."""
        window = self.model.geometry.kv_window
        return 0 < window < self.position

    # ------------------------------------------------------------------ plans
    def _build(self, key: PlanKey) -> Plan:
        """The forward of one chunk of T positions as a list of dispatches (docs/gpu-layout.md).

        The tied head (8192 rows shipped) is applied to the chunk's last position only, unless
        ``key.all_logits`` asks for the logits of all of them (tests, analysis).
        """
        T, sample = key.positions, key.sample
        m, g, dev = self.model, self.model.geometry, self.device
        arena = UniformArena(dev, capacity=1 << 17, label=f"uniforms.T{T}")
        plan = Plan(dev, f"chunk T={T}")
        step = Binding(self.step_uniform)
        cells = self.cells
        deploy = m.deploy  # A8 inside the kernels that prepare a CQ product's input (§4.9)
        pads = self.tokens if self.pad_masked else None  # the ids the pad mask reads (§U a)
        embed_ops.embed(plan, arena, step, geometry=g, pack=m.embedding, levels=m.levels, tokens=self.tokens,
                        lanes=self.lanes, positions=T, cells=cells)
        build_engram(plan, arena, m, self, step, T, ekv=self.ekv, ev=self.ev)

        compiled = dev.pipeline_count

        def attend(plan: Plan, arena: UniformArena, layer: int, kept: int) -> None:
            shape = attention_ops.needle3_shape(g, layer)
            attention_ops.qkv_post(plan, arena, step, shape=shape, layer=kept, fp16_store=m.fp16, qkvg=self.qkvg,
                                   ring=self.qkv_rings[layer], ring_size=self.ring, q_out=self.q,
                                   cache=self.caches[layer], positions=T, int8=self.int8,
                                   q_quant=deploy and not self.int8, kv_levels=self.kv_levels, pad_tokens=pads)
            attention_ops.attention(plan, arena, step, shape=shape, q=self.q, cache=self.caches[layer],
                                    gate=self.qkvg, o=self.o, positions=T, int8=self.int8, pad_tokens=pads,
                                    partials=self.partials, label=f"attention {layer}")

        build_blocks(plan, arena, m, self, T, attend, cells=cells)
        scored = T if key.all_logits else 1
        build_head(plan, arena, m, self, T, scored)
        if cells is not None:
            self._build_probe_pool(plan, arena, T)
        if dev.pipeline_count != compiled:
            m.report("compile", g.num_layers, g.num_layers)
        if sample is not None and key.every_position and key.all_logits:  # speculative verify
            for t in range(T):  # the id after position pos0 + t goes to tokens[pos0 + t + 1]
                sample_ops.sample(plan, arena, step, logits=self.logits, logits_offset=t * g.head_rows,
                                  rows=g.head_rows, tokens=self.tokens, result=self.result, context=self.context,
                                  positions=t + 1, sampling=sample)
        elif sample is not None:
            sample_ops.sample(plan, arena, step, logits=self.logits, logits_offset=(scored - 1) * g.head_rows,
                              rows=g.head_rows, tokens=self.tokens, result=self.result, context=self.context,
                              positions=T, sampling=sample, mask=self.mask if key.mask else None)
        return plan

    def _build_probe_pool(self, plan: Plan, arena: UniformArena, T: int) -> None:
        """§7 step 1 for the chunk: the cells prepared once, then per head its probe scores per
        cell (bands of cq_matmul) and its pool."""
        m, g = self.model, self.model.geometry
        G, d = m.group, g.d_model
        C, d_pad = g.num_layers + 1, _pad(g.d_model, G)
        cq.prepare(plan, arena, self.cells, self.cellsh, width=d, group=G, positions=T * C, x_stride=d)
        for code, (scores, state) in self.pools.items():
            k = m.heads[code].per_cell
            for cell in range(C):
                cq.matmul(plan, arena, m.head_probes[code], m.levels, self.cellsh, scores, positions=T,
                          x_stride=C * d_pad, x_offset=cell * d_pad, y_stride=C * k, y_offset=cell * k,
                          row_start=m.rung.cells[cell] * k, rows=k)
            probe_ops.pool(plan, arena, Binding(self.step_uniform), scores=scores, cells=self.cells, state=state,
                           tokens=self.tokens, d=d, positions=T, probes=C * k, per_cell=k, cells_count=C)

    def head_output(self, code: int) -> list:
        """The output of head ``code`` over every position this session has run (§7): the
        confidence logit [1], the router's 3 logits, or the unit embedding."""
        if code not in self.pools:
            raise NeedleError(f"this session does not run the {probe_ops.HEAD_NAMES.get(code, code)} head")
        if self.position == 0:
            raise NeedleError("a probe head needs at least one position")
        out = self.model.heads[code].output(self._pool_state(code))
        if out is None:
            raise InputError("a probe head needs at least one token that is not the pad id 0")
        return out

    def _pool_state(self, code: int) -> bytes:
        rows = self.model.heads[code].probe_rows
        return self.device.read(self.pools[code][1], 4 * rows * (self.model.geometry.d_model + 2))

    def confidence_logit_so_far(self) -> float:
        """The confidence logit over every position run so far (a generation's own forward);
        0.0 (probability 0.5: no evidence) while every position was the pad id 0."""
        if probe_ops.CONFIDENCE not in self.pools:
            raise NeedleError("create the session with confidence=True to score confidence")
        return self.model.confidence.logit(self._pool_state(probe_ops.CONFIDENCE))

    def confidence_logit(self, ids: list) -> float:
        """The confidence head's logit over ``ids`` (prompt + completion, BOS first; §7)."""
        if self.cells is None:
            raise NeedleError("create the session with confidence=True to score confidence")
        ids = session_ids(ids)
        if not ids:
            return 0.0  # no evidence either way: probability 0.5
        self.prefill(ids)
        return self.confidence_logit_so_far()


def heads_requested(heads) -> tuple:
    """Manifest codes a session is asked to run: a tuple of ints from 1..3 (§U a)."""
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise InputError("heads must be a sequence of head codes (1 embedding, 2 confidence, 3 router)")
    codes = []
    for code in heads:
        if type(code) is not int or code not in probe_ops.HEAD_NAMES:
            raise InputError(f"unknown probe head {code!r} (1 embedding, 2 confidence, 3 router)")
        if code not in codes:
            codes.append(code)
    return tuple(codes)
