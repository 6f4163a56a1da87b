// Q/K/V after the projections (spec §4.5 items 4-7, §6 items 1-2), one workgroup per position
// t of the chunk, p = pos0 + t:
//
//   conv    x'_c = Σ_j taps[j][c] · raw_{p-j, c}   (raw_{<0} = 0; identity when taps = 0)
//   norm    per q/k head: (1 + s_i) · x_i / sqrt(mean(x²) + ε)   (division form, §0 item 2)
//   RoPE    half-split pairs (i, i + hd/2), angle = f32(p) · f_i   (f_i from the host, in f32)
//   int8    q fake-quantised per head (A8); K and V quantised per (slot, kv head) (§6 item 1)
//   deploy  (f32 cache, §4.9 points 4-5) Q_QUANT: q fake-quantised per head (A8); KV_CQ = b > 0:
//           each K and V head vector replaced by its CQ round trip at group 64 (zero-padded to
//           64, rot = H64·x, nearest of the 2^b levels to rot/‖rot‖ (ties to the lower), times
//           ‖rot‖ rounded to FP16, H64 again, cut to the head width), then stored as f32
//
// raw_{p-j} comes from this chunk's qkvg row when p - j >= pos0 and from the ring
// [ring_slots][q+k+v] (slot = position mod ring_slots) otherwise. After reading, every
// invocation stores its own raw channel into the ring at slot p mod ring_slots; the op asserts
// ring_slots >= T + taps - 1, so no slot read by this chunk is written by it.
//
// Outputs: q [T][q_stride] (normed, RoPE'd; fake-quantised in int8 mode), and K (normed,
// RoPE'd) and V (post-conv only) into the cache at slot p mod cache_slots. The cache is one
// u32 buffer: f32 mode K [slots][kv][qk] at k_at, V [slots][kv][vd] at v_at (f32 bit patterns);
// int8 mode rows of 4 signed bytes per word (element e in byte e % 4) plus f32 scales
// [slots][kv] at k_scale_at / v_scale_at.
//
// With PAD_MASK (upstream's hidden cells, Needle 3 §U a) conv tap j >= 1 is skipped where
// tokens[p - j] = 0 (the pad id).
//
// Constants: CAP (>= q+k+v widths), INT8 (bool), Q_QUANT (bool), KV_CQ (0, or the CQ width b;
// head widths <= 64), PIO2_1..PIO2_4 (π/2 split for the angle reduction: three 8-bit parts and
// the f32 remainder), PAD_MASK (bool).

struct Params {
  heads: u32,         // H
  kv_heads: u32,      // KV
  qk_dim: u32,        // per-head q/k width
  v_dim: u32,         // per-head v width
  qkvg_stride: u32,   // floats between positions in qkvg
  taps: u32,          // conv taps (0: no conv)
  ring_slots: u32,
  cache_slots: u32,
  q_stride: u32,      // floats between positions in q
  q_taps_at: u32,     // half offsets into fp16
  k_taps_at: u32,
  v_taps_at: u32,
  q_norm_at: u32,
  k_norm_at: u32,
  k_at: u32,          // word offsets into cache
  v_at: u32,
  k_scale_at: u32,
  v_scale_at: u32,
  k_row: u32,         // words per (slot, kv head) row: qk (f32) or ceil(qk / 4) (int8)
  v_row: u32,
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
  _pad3: u32,
  freqs: array<vec4<f32>, 32>,  // RoPE inverse frequencies f_i, i < qk / 2
  kv_levels: array<vec4<f32>, 4>,  // KV_CQ: the 2^b levels at group 64, ascending (else unused)
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> qkvg: array<f32>;
@group(0) @binding(3) var<storage, read> fp16: array<u32>;
@group(0) @binding(4) var<storage, read_write> ring: array<f32>;
@group(0) @binding(5) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> cache: array<u32>;
@group(0) @binding(7) var<storage, read> tokens: array<u32>;  // read with PAD_MASK only

//#include include/fp16.wgsl

const THREADS: u32 = 256u;
const MAX_VECTORS: u32 = 256u;  // H + 2·KV head vectors
const MAX_HALF: u32 = 128u;     // qk / 2
const EPS: f32 = 1e-6;

var<workgroup> qkv: array<f32, CAP>;                  // the position's q, k, v (q+k+v floats)
var<workgroup> per_vector: array<f32, MAX_VECTORS>;   // norm denominators, then int8 scales
var<workgroup> angle: array<f32, MAX_HALF>;
var<workgroup> cos_table: array<f32, MAX_HALF>;
var<workgroup> sin_table: array<f32, MAX_HALF>;

//#include include/rope_cos_sin.wgsl

//#include include/div_rn.wgsl
//#include include/half_grid.wgsl

fn pack4(at: u32, count: u32, scale: f32) -> u32 {
  var word = 0u;
  for (var e = 0u; e < 4u; e++) {
    if (e < count) {
      word |= (bitcast<u32>(quantize_i8(qkv[at + e], scale)) & 0xFFu) << (8u * e);
    }
  }
  return word;
}

fn freq(i: u32) -> f32 {
  return params.freqs[i / 4u][i % 4u];
}

const KV_GROUP: u32 = 64u;

fn kv_level(i: u32) -> f32 {
  return params.kv_levels[i / 4u][i % 4u];
}

// Normalised 64-point Walsh–Hadamard transform in place (Sylvester order, scale 1/8 exact).
fn fwht64(v: ptr<function, array<f32, 64>>) {
  for (var h = 1u; h < KV_GROUP; h <<= 1u) {
    for (var p = 0u; p < KV_GROUP / 2u; p++) {
      let i = (p / h) * 2u * h + (p % h);
      let a = (*v)[i];
      let b = (*v)[i + h];
      (*v)[i] = a + b;
      (*v)[i + h] = a - b;
    }
  }
  for (var i = 0u; i < KV_GROUP; i++) {
    (*v)[i] = (*v)[i] * 0.125;
  }
}

// qkv[at : at + len] <- its CQ round trip at group 64 with the KV_CQ-bit levels (§4.9 point 5,
// reference.ops.cq_fake_quant), by one invocation.
fn cq_round_trip(at: u32, len: u32) {
  var v: array<f32, 64>;
  for (var i = 0u; i < KV_GROUP; i++) {
    v[i] = select(0.0, qkv[at + min(i, len - 1u)], i < len);
  }
  fwht64(&v);
  var squares = 0.0;
  for (var i = 0u; i < KV_GROUP; i++) {
    squares += v[i] * v[i];
  }
  let norm = sqrt(squares);
  let divisor = max(norm, 1e-12);
  let stored = to_half_grid(norm);
  let count = 1u << KV_CQ;
  for (var i = 0u; i < KV_GROUP; i++) {
    let magnitude = div_rn(abs(v[i]), divisor);
    let unit = select(magnitude, -magnitude, v[i] < 0.0);
    // searchsorted (first level >= unit), clipped to [1, count - 1], then the closer
    // neighbour, the lower one when equally close.
    var pos = 1u;
    while (pos < count - 1u && kv_level(pos) < unit) {
      pos++;
    }
    let left = kv_level(pos - 1u);
    let right = kv_level(pos);
    v[i] = select(right, left, abs(unit - left) <= abs(unit - right)) * stored;
  }
  fwht64(&v);
  for (var i = 0u; i < len; i++) {
    qkv[at + i] = v[i];
  }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let t = wg.x;
  let pos0 = chunk.pos0;
  let p = pos0 + t;
  let qk = params.qk_dim;
  let vd = params.v_dim;
  let qw = params.heads * qk;
  let kw = params.kv_heads * qk;
  let vw = params.kv_heads * vd;
  let width = qw + kw + vw;
  let half_dim = qk / 2u;

  // 1. causal conv (§4.5 item 4) and the ring update.
  for (var c = lid; c < width; c += THREADS) {
    let raw = qkvg[t * params.qkvg_stride + c];
    var value = raw;
    if (params.taps > 0u) {
      var taps_at = params.q_taps_at + c;
      var channels = qw;
      if (c >= qw + kw) {
        taps_at = params.v_taps_at + (c - qw - kw);
        channels = vw;
      } else if (c >= qw) {
        taps_at = params.k_taps_at + (c - qw);
        channels = kw;
      }
      value = 0.0;
      for (var j = 0u; j < params.taps && j <= p; j++) {
        let src = p - j;
        if (PAD_MASK && j > 0u && tokens[src] == 0u) {
          continue;
        }
        var x: f32;
        if (src >= pos0) {
          x = qkvg[(src - pos0) * params.qkvg_stride + c];
        } else {
          x = ring[(src % params.ring_slots) * width + c];
        }
        value += half_at(taps_at + j * channels) * x;
      }
    }
    qkv[c] = value;
    ring[(p % params.ring_slots) * width + c] = raw;
  }
  workgroupBarrier();

  // 2. per-head norm denominators (§4.5 item 6) and the RoPE angles (item 7). The angle goes
  //    through workgroup memory so it is the rounded f32 product (no contraction into the
  //    reduction that follows).
  for (var h = lid; h < params.heads + params.kv_heads; h += THREADS) {
    var sum = 0.0;
    for (var i = 0u; i < qk; i++) {
      let x = qkv[h * qk + i];
      sum += x * x;
    }
    per_vector[h] = sqrt(sum / f32(qk) + EPS);
  }
  for (var i = lid; i < half_dim; i += THREADS) {
    angle[i] = f32(p) * freq(i);
  }
  workgroupBarrier();

  for (var i = lid; i < half_dim; i += THREADS) {
    let cs = rope_cos_sin(angle[i]);
    cos_table[i] = cs.x;
    sin_table[i] = cs.y;
  }
  for (var c = lid; c < qw + kw; c += THREADS) {
    let i = c % qk;
    let s = half_at(select(params.q_norm_at, params.k_norm_at, c >= qw) + i);
    qkv[c] = ((1.0 + s) * qkv[c]) / per_vector[c / qk];
  }
  workgroupBarrier();

  // 3. RoPE, half_dim-split pairs, in place.
  for (var idx = lid; idx < (params.heads + params.kv_heads) * half_dim; idx += THREADS) {
    let i = idx % half_dim;
    let a = (idx / half_dim) * qk + i;
    let x1 = qkv[a];
    let x2 = qkv[a + half_dim];
    let c = cos_table[i];
    let s = sin_table[i];
    qkv[a] = x1 * c - x2 * s;
    qkv[a + half_dim] = x2 * c + x1 * s;
  }
  workgroupBarrier();

  let slot = p % params.cache_slots;
  if (INT8) {
    // 4. int8: one scale per q head, k head and v head: absmax / 127, or 1 for a zero vector.
    let vectors = params.heads + 2u * params.kv_heads;
    for (var h = lid; h < vectors; h += THREADS) {
      var at = h * qk;
      var len = qk;
      if (h >= params.heads + params.kv_heads) {
        at = qw + kw + (h - params.heads - params.kv_heads) * vd;
        len = vd;
      }
      var absmax = 0.0;
      for (var i = 0u; i < len; i++) {
        absmax = max(absmax, abs(qkv[at + i]));
      }
      per_vector[h] = a8_scale(absmax);
    }
    workgroupBarrier();
    for (var c = lid; c < qw; c += THREADS) {
      let scale = per_vector[c / qk];
      q_out[t * params.q_stride + c] = f32(quantize_i8(qkv[c], scale)) * scale;
    }
    let k_words = params.kv_heads * params.k_row;
    for (var w = lid; w < k_words; w += THREADS) {
      let kv = w / params.k_row;
      let e = (w % params.k_row) * 4u;
      let word = pack4(qw + kv * qk + e, min(4u, qk - e), per_vector[params.heads + kv]);
      cache[params.k_at + slot * k_words + w] = word;
    }
    let v_words = params.kv_heads * params.v_row;
    for (var w = lid; w < v_words; w += THREADS) {
      let kv = w / params.v_row;
      let e = (w % params.v_row) * 4u;
      let word = pack4(qw + kw + kv * vd + e, min(4u, vd - e), per_vector[params.heads + params.kv_heads + kv]);
      cache[params.v_at + slot * v_words + w] = word;
    }
    for (var kv = lid; kv < params.kv_heads; kv += THREADS) {
      cache[params.k_scale_at + slot * params.kv_heads + kv] = bitcast<u32>(per_vector[params.heads + kv]);
      cache[params.v_scale_at + slot * params.kv_heads + kv] =
          bitcast<u32>(per_vector[params.heads + params.kv_heads + kv]);
    }
  } else {
    // 4. f32: q out, K and V rows into the cache slot; deploy numerics first quantise q per
    //    head and round-trip each K and V head through CQ (§4.9 points 4-5).
    if (Q_QUANT) {
      for (var h = lid; h < params.heads; h += THREADS) {
        var absmax = 0.0;
        for (var i = 0u; i < qk; i++) {
          absmax = max(absmax, abs(qkv[h * qk + i]));
        }
        per_vector[h] = a8_scale(absmax);
      }
    }
    if (KV_CQ > 0u) {
      for (var h = lid; h < 2u * params.kv_heads; h += THREADS) {
        if (h < params.kv_heads) {
          cq_round_trip(qw + h * qk, qk);
        } else {
          cq_round_trip(qw + kw + (h - params.kv_heads) * vd, vd);
        }
      }
    }
    if (Q_QUANT || KV_CQ > 0u) {
      workgroupBarrier();
    }
    for (var c = lid; c < qw; c += THREADS) {
      if (Q_QUANT) {
        let scale = per_vector[c / qk];
        q_out[t * params.q_stride + c] = f32(quantize_i8(qkv[c], scale)) * scale;
      } else {
        q_out[t * params.q_stride + c] = qkv[c];
      }
    }
    for (var c = lid; c < kw; c += THREADS) {
      cache[params.k_at + slot * kw + c] = bitcast<u32>(qkv[qw + c]);
    }
    for (var c = lid; c < vw; c += THREADS) {
      cache[params.v_at + slot * vw + c] = bitcast<u32>(qkv[qw + kw + c]);
    }
  }
}
