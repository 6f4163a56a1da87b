// Causal GQA attention, with Needle 3's elementwise output gate or plain (Needle 3 §4.5 items
// 8-9, §6 item 1; dense §3), one workgroup per (query head hq, position t), p = pos0 + t,
// kv head = hq / (H / KV):
//
//   s_n = (q · k_n) · scale                        f32 and f16 caches (scale = 1/sqrt(qk)
//   s_n = ((q · k8_n) · k_scale_n) · scale         int8 cache   unless the family says otherwise)
//   o   = Σ_n softmax(s)_n · v_n   (int8: weights softmax_n · v_scale_n times the i8 values)
//   out[t][hq·vd + j] = o_j · σ(g_j) with GATE (g: the gate rows at gate_offset), else o_j
//
// over n in [lo, p], lo = p + 1 - span when p + 1 > span, else 0 (span = the sliding window, or
// the whole context for global layers). Key n lives in cache slot n mod cache_slots; the
// cache must hold span + T - 1 slots (or the whole context) so that this chunk's writes never
// overwrite a key one of its queries still needs (the op asserts it).
//
// Keys are visited in blocks of 256, one key per invocation for the score; the softmax is
// online across blocks (running max, every partial rescaled when it grows). For the values,
// invocation (g, j) = (lid / VCOLS, lid % VCOLS) sums column j over the keys i ≡ g (mod
// GROUPS) of a block; the GROUPS partials are added at the end.
//
// Cache layout (one u32 buffer, kernels/attention.py KvCache), KV_MODE:
//   0 f32:  K [slots][KV][qk] at k_at and V [slots][KV][vd] at v_at as f32 bits (qkv_post, qk_rope)
//   1 int8: rows of k_row / v_row words holding 4 signed bytes each (element e in byte e % 4) and
//           f32 scales [slots][KV] at k_scale_at / v_scale_at (qkv_post, Needle 3)
//   2 f16:  rows of k_row / v_row words holding 2 IEEE halves each (element e in the low half of
//           word e / 2 when e is even), read with unpack2x16float: core WGSL, no shader-f16
//           (qk_rope, the dense family). The products and sums are f32, in the f32 mode's order.
//
// With PAD_MASK (upstream's hidden cells, Needle 3 §U a), key n is also skipped where
// tokens[n] = 0 (the pad id), and a query that sees no key gets zeros.
//
// Constants: KV_MODE (0, 1, 2), GATE (bool), VCOLS (power of two >= vd, <= 256), QK_DIM, K_ROW
// (words per K row), PAD_MASK (bool). Loop bounds are constants: lavapipe recompiles a shader at every dispatch
// whose control flow depends on uniform values alone.

struct Params {
  heads: u32,
  kv_heads: u32,
  qk_dim: u32,
  v_dim: u32,
  span: u32,          // keys visible from a query, itself included
  cache_slots: u32,
  q_stride: u32,      // floats between positions in q
  gate_stride: u32,   // floats between positions in gates
  gate_offset: u32,   // float offset of the gate inside a gates row (Needle 3: q + k + v widths)
  o_stride: u32,      // floats between positions in o
  k_at: u32,          // word offsets into cache
  v_at: u32,
  k_scale_at: u32,
  v_scale_at: u32,
  k_row: u32,         // words per (slot, kv head) row
  v_row: u32,
  scale: f32,         // the score scale (f32 of 1 / sqrt(qk) by default)
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> cache: array<u32>;
@group(0) @binding(4) var<storage, read> gates: array<f32>;  // q again without GATE
@group(0) @binding(5) var<storage, read_write> o: array<f32>;
@group(0) @binding(6) var<storage, read> tokens: array<u32>;  // read with PAD_MASK only

const THREADS: u32 = 256u;
const BLOCK: u32 = 256u;        // keys per block, one per invocation
const MAX_HEAD_DIM: u32 = 256u;
const GROUPS: u32 = THREADS / VCOLS;
const LOWEST: f32 = -3.0e38;    // the running max before the first key
const KV_INT8: u32 = 1u;        // KV_MODE values (0: f32)
const KV_F16: u32 = 2u;

var<workgroup> query: array<f32, MAX_HEAD_DIM>;
var<workgroup> weights: array<f32, BLOCK>;    // a block's softmax numerators (· v_scale in int8)
var<workgroup> key_row: array<u32, BLOCK>;
var<workgroup> reduction: array<f32, THREADS>;

// Signed byte e % 4 of a packed word.
fn byte_at(word: u32, e: u32) -> f32 {
  return f32(bitcast<i32>(word << (24u - 8u * (e % 4u))) >> 24u);
}

fn score(row: u32) -> f32 {
  let qk = QK_DIM;
  var dot = 0.0;
  if (KV_MODE == KV_F16) {
    let base = params.k_at + row * params.k_row;
    for (var w = 0u; w < K_ROW; w++) {
      let pair = unpack2x16float(cache[base + w]);
      dot += query[2u * w] * pair.x;
      if (QK_DIM % 2u == 0u || 2u * w + 1u < qk) {
        dot += query[2u * w + 1u] * pair.y;
      }
    }
    return dot * params.scale;
  }
  if (KV_MODE == KV_INT8) {
    let base = params.k_at + row * params.k_row;
    for (var w = 0u; w < K_ROW; w++) {
      let word = cache[base + w];
      let e = 4u * w;
      for (var b = 0u; b < 4u; b++) {
        if (e + b < qk) {
          dot += query[e + b] * byte_at(word, b);
        }
      }
    }
    return (dot * bitcast<f32>(cache[params.k_scale_at + row])) * params.scale;
  }
  let base = params.k_at + row * params.k_row;
  for (var i = 0u; i < qk; i++) {
    dot += query[i] * bitcast<f32>(cache[base + i]);
  }
  return dot * params.scale;
}

fn value(row: u32, j: u32) -> f32 {
  if (KV_MODE == KV_F16) {
    let pair = unpack2x16float(cache[params.v_at + row * params.v_row + j / 2u]);
    return select(pair.x, pair.y, (j & 1u) == 1u);
  }
  if (KV_MODE == KV_INT8) {
    return byte_at(cache[params.v_at + row * params.v_row + j / 4u], j);
  }
  return bitcast<f32>(cache[params.v_at + row * params.v_row + j]);
}

fn reduce_max(lid: u32) {
  for (var stride = THREADS / 2u; stride > 0u; stride >>= 1u) {
    if (lid < stride) {
      reduction[lid] = max(reduction[lid], reduction[lid + stride]);
    }
    workgroupBarrier();
  }
}

fn reduce_sum(lid: u32) {
  for (var stride = THREADS / 2u; stride > 0u; stride >>= 1u) {
    if (lid < stride) {
      reduction[lid] += reduction[lid + stride];
    }
    workgroupBarrier();
  }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let hq = wg.x;
  let t = wg.y;
  let p = chunk.pos0 + t;
  let qk = QK_DIM;
  let vd = params.v_dim;
  let kv = hq / (params.heads / params.kv_heads);
  var lo = 0u;
  if (p + 1u > params.span) {
    lo = p + 1u - params.span;
  }
  let count = p + 1u - lo;

  for (var i = lid; i < qk; i += THREADS) {
    query[i] = q[t * params.q_stride + hq * qk + i];
  }
  workgroupBarrier();

  let j = lid % VCOLS;
  let g = lid / VCOLS;
  var running_max = LOWEST;
  var partial_sum = 0.0;  // this invocation's keys (one per block)
  var partial_out = 0.0;  // column j over the keys i ≡ g (mod GROUPS)
  for (var start = 0u; start < count; start += BLOCK) {
    let inside = start + lid < count;
    var valid = inside;
    var s = LOWEST;
    var row = 0u;
    if (inside) {
      let slot = (lo + start + lid) % params.cache_slots;
      row = slot * params.kv_heads + kv;
      key_row[lid] = row;  // set for a masked key too: its weight 0 still multiplies a value
      if (PAD_MASK) {
        valid = tokens[lo + start + lid] != 0u;
      }
    }
    if (valid) {
      s = score(row);
    }
    reduction[lid] = s;
    workgroupBarrier();
    reduce_max(lid);
    let block_max = max(running_max, reduction[0]);
    let rescale = exp(running_max - block_max);
    running_max = block_max;
    var e = 0.0;
    if (valid) {
      e = exp(s - block_max);
    }
    partial_sum = partial_sum * rescale + e;
    if (KV_MODE == KV_INT8 && valid) {
      weights[lid] = e * bitcast<f32>(cache[params.v_scale_at + row]);
    } else {
      weights[lid] = e;
    }
    partial_out *= rescale;
    workgroupBarrier();
    if (j < vd) {
      let keys = min(BLOCK, count - start);
      for (var i = g; i < keys; i += GROUPS) {
        partial_out += weights[i] * value(key_row[i], j);
      }
    }
    workgroupBarrier();
  }

  reduction[lid] = partial_sum;
  weights[lid] = partial_out;
  workgroupBarrier();
  reduce_sum(lid);
  if (lid < vd) {
    var total = 0.0;
    for (var k = 0u; k < GROUPS; k++) {
      total += weights[k * VCOLS + lid];
    }
    var attended = total * (1.0 / reduction[0]);
    if (PAD_MASK && reduction[0] == 0.0) {
      attended = 0.0;  // every visible key is a pad
    }
    if (GATE) {
      let gate = gates[t * params.gate_stride + params.gate_offset + hq * vd + lid];
      o[t * params.o_stride + hq * vd + lid] = attended * (1.0 / (1.0 + exp(-gate)));
    } else {
      o[t * params.o_stride + hq * vd + lid] = attended;
    }
  }
}
