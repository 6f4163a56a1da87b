// Dense q/k/v after the projections (dense spec §3), one workgroup per (head vector h, position t),
// p = pos0 + t. h < HEADS is query head h, HEADS <= h < HEADS + KV_HEADS key head h - HEADS, the
// rest value heads:
//
//   bias   x += b                                                   BIAS (qwen2)
//   norm   q, k: x_i · (1 / sqrt(mean(x²) + eps)) · w_i              NORM 1: mean over the head,
//          w [qk] shared by the heads (qwen3, gemma3); NORM 2: mean over all of q (or k),
//          w [HEADS·qk] ([KV_HEADS·qk]) (OLMoE). v is never normed.
//   RoPE   q, k: pairs (x_2j, x_2j+1) (ROPE 1, adjacent: llama GGUFs) or (x_j, x_j+R/2) (ROPE 2,
//          NeoX), j < R/2 = ROPE_HALF, angle = f32(p)·f_j, c, s = m·cos, m·sin (m = rope_mscale),
//          (a, b) <- (a·c - b·s, a·s + b·c); dims >= R are not rotated
//   out    q heads into q_out [T][q_stride]; K and V heads into cache slot p mod cache_slots:
//          rows [slots][KV][K_ROW] of words at k_at, [slots][KV][V_ROW] at v_at. KV_MODE 0: f32
//          bits (as qkv_post). KV_MODE 2: two halves per word (element e in the low half of word
//          e / 2 when e is even; an odd width's last high half 0), each value clamped to
//          ±65504 and rounded to the nearest half, ties to even, in f32 (to_half_grid), then
//          pack2x16float: WGSL lets that builtin pick either neighbour and leaves out-of-range
//          values indeterminate, but an exact half in range packs the same on every adapter.
//          Core WGSL, no shader-f16.
//
// qkv rows hold q, k and v at float offsets q_offset, k_offset, v_offset; `vectors` holds the
// layer's norm weights and biases at float offsets (bound only when BIAS or NORM).
//
// Constants: HEADS, KV_HEADS, QK_DIM, V_DIM, ROPE, ROPE_HALF, NORM, BIAS, KV_MODE (0 f32, 2 f16),
// K_ROW, V_ROW (words per cache row), PIO2_1..PIO2_4, SEQUENCES, SEQ_ROWS.
//
// With SEQUENCES the T rows are a batch's, each a sequence of its own: row t is at its position
// in `sequences` and writes K/V at its slot (slot · slot_words words into the bound page); a
// dispatch takes only the rows of its page. Sizes
// are constants: lavapipe recompiles a shader at every dispatch whose control flow depends on
// uniform values alone.

struct Params {
  qkv_stride: u32,   // floats between positions in qkv
  q_offset: u32,     // float offsets inside a qkv row
  k_offset: u32,
  v_offset: u32,
  q_stride: u32,     // floats between positions in q_out
  cache_slots: u32,
  k_at: u32,         // word offsets into cache
  v_at: u32,
  q_norm_at: u32,    // float offsets into vectors
  k_norm_at: u32,
  q_bias_at: u32,
  k_bias_at: u32,
  v_bias_at: u32,
  eps: f32,
  rope_mscale: f32,  // RoPE magnitude m (YaRN / LongRoPE attention factor; 1 otherwise)
  slot_words: u32,   // SEQUENCES: words between the slots of a page
  page: u32,         // SEQUENCES: the page whose rows this dispatch takes
  _pad1: u32,
  _pad2: u32,
  _pad3: u32,
  freqs: array<vec4<f32>, 32>,  // RoPE inverse frequencies f_j, j < ROPE_HALF
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> vectors: array<f32>;
@group(0) @binding(4) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(5) var<storage, read_write> cache: array<u32>;
// SEQUENCES: per row (a batch's) its position, its slot inside the page, its page
@group(0) @binding(6) var<uniform> sequences: array<vec4<u32>, SEQ_ROWS>;

const THREADS: u32 = 64u;
const MAX_HEAD_DIM: u32 = 256u;
const KV_F16: u32 = 2u;
var<workgroup> x: array<f32, MAX_HEAD_DIM>;
var<workgroup> partial: array<f32, THREADS>;
var<workgroup> angle: array<f32, 128>;

//#include include/rope_cos_sin.wgsl

//#include include/half_grid.wgsl

fn half_pair(a: f32, b: f32) -> u32 {
  return pack2x16float(vec2<f32>(to_half_grid(a), to_half_grid(b)));
}

fn biased(at: u32, bias_at: u32) -> f32 {
  if (BIAS) {
    return qkv[at] + vectors[bias_at];
  }
  return qkv[at];
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let h = wg.x;
  let t = wg.y;
  var p = chunk.pos0 + t;
  var base = 0u;  // the word offset of this row's cache in the bound buffer
  if (SEQUENCES) {  // a uniform condition: the table is a uniform indexed by the workgroup
    if (sequences[t].z != params.page) {
      return;
    }
    p = sequences[t].x;
    base = sequences[t].y * params.slot_words;
  }
  let row = t * params.qkv_stride;

  // Which vector: kind 0 q, 1 k, 2 v; its head, width, source and bias offsets.
  var kind = 0u;
  var head = h;
  var dim = QK_DIM;
  var part = params.q_offset;      // start of all of q (or k, v) in the row
  var bias_part = params.q_bias_at;
  var norm_at = params.q_norm_at;
  var part_width = HEADS * QK_DIM;
  if (h >= HEADS + KV_HEADS) {
    kind = 2u;
    head = h - HEADS - KV_HEADS;
    dim = V_DIM;
    part = params.v_offset;
    bias_part = params.v_bias_at;
    part_width = KV_HEADS * V_DIM;
  } else if (h >= HEADS) {
    kind = 1u;
    head = h - HEADS;
    part = params.k_offset;
    bias_part = params.k_bias_at;
    norm_at = params.k_norm_at;
    part_width = KV_HEADS * QK_DIM;
  }
  let own = head * dim;  // this head's offset inside its part

  // 1. load (+ bias) and the sum of squares the norm needs.
  var squares = 0.0;
  for (var i = lid; i < dim; i += THREADS) {
    let value = biased(row + part + own + i, bias_part + own + i);
    x[i] = value;
    squares += value * value;
  }
  if (NORM == 2u) {
    squares = 0.0;
    for (var c = lid; c < part_width; c += THREADS) {
      let value = biased(row + part + c, bias_part + c);
      squares += value * value;
    }
  }

  // 2. norm (q and k only): x_i · inv · w_i.
  if (NORM != 0u) {
    partial[lid] = squares;
    workgroupBarrier();
    for (var stride = THREADS / 2u; stride > 0u; stride >>= 1u) {
      if (lid < stride) {
        partial[lid] += partial[lid + stride];
      }
      workgroupBarrier();
    }
    let count = select(dim, part_width, NORM == 2u);
    let inv = 1.0 / sqrt(partial[0] / f32(count) + params.eps);
    let weight_at = norm_at + select(0u, own, NORM == 2u);
    if (kind < 2u) {
      for (var i = lid; i < dim; i += THREADS) {
        x[i] = (x[i] * inv) * vectors[weight_at + i];
      }
    }
  }

  // 3. RoPE on q and k. The angle goes through workgroup memory so it is the rounded f32
  //    product (no contraction into the reduction that follows).
  if (ROPE != 0u) {
    for (var j = lid; j < ROPE_HALF; j += THREADS) {
      angle[j] = f32(p) * params.freqs[j / 4u][j % 4u];
    }
  }
  workgroupBarrier();
  if (ROPE != 0u && kind < 2u) {
    for (var j = lid; j < ROPE_HALF; j += THREADS) {
      let cs = rope_cos_sin(angle[j]) * params.rope_mscale;  // (m·c, m·s), as llama.cpp scales them
      var a = j;
      var b = j + ROPE_HALF;
      if (ROPE == 1u) {
        a = 2u * j;
        b = 2u * j + 1u;
      }
      let xa = x[a];
      let xb = x[b];
      x[a] = xa * cs.x - xb * cs.y;
      x[b] = xa * cs.y + xb * cs.x;
    }
  }
  workgroupBarrier();

  // 4. out: q to q_out, k and v into the cache slot.
  let slot = p % params.cache_slots;
  var cache_at = base + params.k_at + (slot * KV_HEADS + head) * K_ROW;
  if (kind == 2u) {
    cache_at = base + params.v_at + (slot * KV_HEADS + head) * V_ROW;
  }
  if (kind == 0u) {
    for (var i = lid; i < dim; i += THREADS) {
      q_out[t * params.q_stride + own + i] = x[i];
    }
  } else if (KV_MODE == KV_F16) {
    for (var w = lid; 2u * w < dim; w += THREADS) {
      let e = 2u * w;
      cache[cache_at + w] = half_pair(x[e], select(0.0, x[e + 1u], e + 1u < dim));
    }
  } else {
    for (var i = lid; i < dim; i += THREADS) {
      cache[cache_at + i] = bitcast<u32>(x[i]);
    }
  }
}
