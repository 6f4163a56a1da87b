// Causal GQA attention, with Needle 3's elementwise output gate or plain (Needle 3 §4.5 items
// 8-9, §6 item 1; dense §3). Query head hq of position p = pos0 + t reads kv head
// kv = hq / (H / KV):
//
//   s_n = (q · k_n) · scale                        f32 and f16 caches (scale = 1/sqrt(qk)
//   s_n = ((q · k8_n) · k_scale_n) · scale         int8 cache   unless the family says otherwise)
//   o   = Σ_n softmax(s)_n · v_n   (int8: softmax_n times v_scale_n · the i8 values)
//   with SOFTCAP > 0 each score is soft-capped first: s = tanh(s · SOFTCAP_INV) · SOFTCAP (gemma2)
//   out[t][hq·vd + j] = o_j · σ(g_j) with GATE (g: the gate rows at gate_offset), else o_j
//
// over n in [lo, p], lo = p + 1 - span when p + 1 > span, else 0 (span = the sliding window, or
// the whole context for global layers). Key n lives in cache slot n mod cache_slots; the
// cache must hold span + T - 1 slots (or the whole context) so that this chunk's writes never
// overwrite a key one of its queries still needs (the op asserts it). With PAD_MASK (upstream's
// hidden cells, Needle 3 §U a), key n is also skipped where tokens[n] = 0 (the pad id), and a
// query that sees no key gets zeros.
//
// Cache layout (one u32 buffer, kernels/attention.py KvCache), KV_MODE:
//   0 f32:  K [slots][KV][qk] at k_at and V [slots][KV][vd] at v_at as f32 bits (qkv_post, qk_rope)
//   1 int8: rows of K_ROW / V_ROW words holding 4 signed bytes each (element e in byte e % 4) and
//           f32 scales [slots][KV] at k_scale_at / v_scale_at (qkv_post, Needle 3)
//   2 f16:  rows of K_ROW / V_ROW words holding 2 IEEE halves each (element e in the low half of
//           word e / 2 when e is even), read with unpack2x16float: core WGSL, no shader-f16
//           (qk_rope, the dense family).
//
// The work is laid out so that it stays bounded per workgroup however long the context grows:
//
// - The cache's slots are cut into SPLITS ranges of SPLIT_BLOCKS blocks of BLOCK slots. Entry
//   `partial`: workgroup (s, kv · HEAD_TILES + head tile, query tile) attends the ROWS =
//   QUERY_TILE · HEAD_TILE rows (query t, head hq of kv head kv) over the slots of range s
//   only, block by block: scores of every row for the block's keys (each key read once for
//   all rows; invocation l scores the keys 4l .. 4l + 3), the block max per row, the
//   exponentials, then the weighted values (each value read once for all rows). The softmax is online across the range's blocks (running max,
//   sums rescaled when it grows). With SPLITS = 1 the workgroup finishes the rows itself:
//   o = Σ / sum (then the gate); otherwise it writes its partial (max, sum, weighted values)
//   to `partials` and entry `merge` (workgroup (hq, t)) combines the SPLITS partials of a row:
//   o = Σ_s acc_s · e^(m_s - M) / Σ_s sum_s · e^(m_s - M), M = max_s m_s (flash-decoding).
// - Slot k holds, for a query at p, the position p - ((p - k) mod slots); the key is visible
//   when that distance is below span and at most p (and, with PAD_MASK, not a pad). A block no
//   row of the tile sees is skipped. A row's result depends only on its position: the slots,
//   blocks and ranges do not move with the chunk, and each row's sums run in the same order
//   in every tile, so a prefill chunk and decode steps give the same bits.
//
// With SEQUENCES the T queries are a batch's rows, each a sequence of its own decoding one
// position (QUERY_TILE 1): query t is at its row's position in `sequences` and reads the cache
// at its slot (slot · slot_words words into the bound page), and a dispatch takes only the rows
// of its page. Each row runs the arithmetic of its own decode step alone, so it gets its bits.
//
// Keys and values are read four elements at a time (a vec4 of f32 words when the rows are
// whole vec4s, QUADS; else the words one by one) and dotted with the queries' vec4s: on
// lavapipe, where a read every invocation makes is a gather, that is a quarter of the reads.
// For the same reason an invocation holds the K rows of its 4 keys in registers (indices
// that are constants once the loops are unrolled), so that each query quad it reads serves 4
// keys, and the scores are kept as vec4s of 4 consecutive keys: one read gives the weighted
// values 4 weights. The scores and the values accumulate per quad of elements, in the same
// order in every mode, so an f16 cache of halves gives the bits of an f32 cache holding the
// same values.
//
// On lavapipe a read is a loop over the 8 lanes of a vector, so only a few reads are in flight
// from memory at once: it pays to read in one loop from as many memory lines as possible. The
// K rows are read so (8 lanes, 8 keys); for the values, the key groups alternate along the
// invocations (8 lanes: 4 keys), and with TOUCH_VALUES (a CPU adapter) step 1 also reads one
// word of each 64-byte line of its 4 keys' V rows, so that the values come from memory with the
// keys, 8 lanes at a time, and step 4 finds them in the cache. Those words only meet `zero`, a
// uniform 0 the compiler cannot fold: the bits are the same either way.
//
// Constants: KV_MODE (0 f32, 1 int8, 2 f16), GATE, PAD_MASK (bool), QK_DIM, K_ROW, V_DIM,
// V_ROW, QUADS (f32 rows of whole vec4s), GROUP (query heads per kv head), BLOCK (keys per
// block: 4 per invocation, 256), HEAD_TILE, HEAD_TILES (GROUP / HEAD_TILE rounded up),
// QUERY_TILE, SPLITS, SPLIT_BLOCKS, SEQUENCES and SEQ_ROWS, TOUCH_VALUES (see above). Loop
// bounds are constants where they can be: lavapipe recompiles a shader at every dispatch whose
// control flow depends on uniform values alone.

struct Params {
  heads: u32,
  kv_heads: u32,
  span: u32,          // keys visible from a query, itself included
  cache_slots: u32,
  positions: u32,     // T, the chunk's queries
  q_stride: u32,      // floats between positions in q
  gate_stride: u32,   // floats between positions in gates
  gate_offset: u32,   // float offset of the gate inside a gates row (Needle 3: q + k + v widths)
  o_stride: u32,      // floats between positions in o
  k_at: u32,          // word offsets into cache
  v_at: u32,
  k_scale_at: u32,
  v_scale_at: u32,
  acc_at: u32,        // float offset of the weighted values in partials (the (max, sum) pairs first)
  scale: f32,         // the score scale
  slot_words: u32,    // SEQUENCES: words between the slots of a page (a slot's cache at slot · slot_words)
  page: u32,          // SEQUENCES: the page whose rows this dispatch takes
  zero: u32,          // 0, which the compiler cannot know (TOUCH_VALUES)
  _pad1: u32,
  _pad2: u32,
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> cache: array<u32>;
@group(0) @binding(4) var<storage, read> gates: array<f32>;  // read with GATE only
@group(0) @binding(5) var<storage, read_write> o: array<f32>;
@group(0) @binding(6) var<storage, read> tokens: array<u32>;  // read with PAD_MASK only
// [T][H][SPLITS] (max, sum) pairs, then at acc_at [T][H][SPLITS][V_DIM] weighted values
@group(0) @binding(7) var<storage, read_write> partials: array<f32>;
@group(0) @binding(8) var<storage, read> cache_quads: array<vec4<u32>>;  // the cache again, read with QUADS
// SEQUENCES: per query (a batch row) its position, its slot inside the page, its page
@group(0) @binding(9) var<uniform> sequences: array<vec4<u32>, SEQ_ROWS>;

const THREADS: u32 = 64u;
const KEY_QUADS: u32 = BLOCK / 4u;  // an invocation's scores are for 4 consecutive keys (BLOCK = 4 · THREADS)
const ROWS: u32 = QUERY_TILE * HEAD_TILE;
const Q_QUADS: u32 = (QK_DIM + 3u) / 4u;
const V_QUADS: u32 = (V_DIM + 3u) / 4u;
const KEY_GROUPS: u32 = THREADS / V_QUADS;  // invocation (g, c) sums quad c of the key quads ≡ g
const LOWEST: f32 = -3.0e38;    // the running max before the first key
const KV_INT8: u32 = 1u;
const KV_F16: u32 = 2u;

var<workgroup> query: array<vec4<f32>, ROWS * Q_QUADS>;  // the tile's queries, 0 past QK_DIM
// A block's scores, then its exponentials, by quads of keys ([ROWS][KEY_QUADS]); at the end the
// weighted values of the key groups.
var<workgroup> scores: array<vec4<f32>, ROWS * KEY_QUADS>;
var<workgroup> value_scale: array<vec4<f32>, KEY_QUADS>; // int8: the key's V scale
var<workgroup> lane_rows: array<f32, ROWS * THREADS>;  // per row and invocation: its block max, at the end its sum
var<workgroup> row_max: array<f32, ROWS>;
var<workgroup> row_rescale: array<f32, ROWS>;
var<workgroup> row_sum: array<f32, ROWS>;
var<workgroup> row_pos: array<u32, ROWS>;
var<workgroup> row_phase: array<u32, ROWS>;        // row_pos mod slots
var<workgroup> row_span: array<u32, ROWS>;         // 0 for a row past the chunk or the group

// Signed byte b of a packed word.
fn byte_at(word: u32, b: u32) -> f32 {
  return f32(bitcast<i32>(word << (24u - 8u * b)) >> 24u);
}

fn bytes_of(word: u32) -> vec4<f32> {
  return vec4<f32>(byte_at(word, 0u), byte_at(word, 1u), byte_at(word, 2u), byte_at(word, 3u));
}

// Elements 4c .. 4c + 3 of the row of `width` elements at word `base` (`words` words a row),
// 0 past the width.
fn quad(base: u32, c: u32, width: u32, words: u32) -> vec4<f32> {
  if (KV_MODE == KV_INT8) {
    return bytes_of(cache[base + c]);  // padding bytes are 0
  }
  if (KV_MODE == KV_F16) {
    let low = unpack2x16float(cache[base + 2u * c]);
    var high = vec2<f32>(0.0);
    if (2u * c + 1u < words) {
      high = unpack2x16float(cache[base + 2u * c + 1u]);  // an odd width's padding half is 0
    }
    return vec4<f32>(low, high);
  }
  if (QUADS) {
    return bitcast<vec4<f32>>(cache_quads[base / 4u + c]);
  }
  var x = vec4<f32>(0.0);
  for (var e = 0u; e < 4u; e++) {
    if (4u * c + e < width) {
      x[e] = bitcast<f32>(cache[base + 4u * c + e]);
    }
  }
  return x;
}

// The position of query t: pos0 + t, or with SEQUENCES its batch row's own.
fn query_position(t: u32) -> u32 {
  if (SEQUENCES) {
    return sequences[t].x;
  }
  return chunk.pos0 + t;
}

// The word offset of query t's cache in the bound buffer: 0, or with SEQUENCES its slot's.
fn cache_base(t: u32) -> u32 {
  if (SEQUENCES) {
    return sequences[t].y * params.slot_words;
  }
  return 0u;
}

// Whether this dispatch takes query t (with SEQUENCES only the rows of its page). A uniform
// value: the table is a uniform indexed by the workgroup.
fn taken_here(t: u32) -> bool {
  return !SEQUENCES || sequences[t].z == params.page;
}

// The slots holding the positions any row of the tile at t0 sees: a circular range (start, count).
fn tile_slots(t0: u32) -> vec2<u32> {
  let first = query_position(t0);
  let last = query_position(min(params.positions, t0 + QUERY_TILE) - 1u);
  var lo = 0u;
  if (first + 1u > params.span) {
    lo = first + 1u - params.span;
  }
  return vec2<u32>(lo % params.cache_slots, last + 1u - lo);
}

// Whether the circular slot range `seen` meets the slots [k0, k0 + len).
fn meets(seen: vec2<u32>, k0: u32, len: u32) -> bool {
  let slots = params.cache_slots;
  if (seen.y >= slots) {
    return true;
  }
  return (k0 + slots - seen.x) % slots < seen.y || (seen.x + slots - k0) % slots < len;
}

// Whether row r sees the keys i .. i + 3 of the block at k0 (`keys` of them in the cache): the
// position each slot holds for the row is in its window (and, with PAD_MASK, not a pad).
fn row_sees(r: u32, k0: u32, i: u32, keys: u32) -> vec4<bool> {
  let slots = params.cache_slots;
  let p = row_pos[r];
  let offsets = vec4<u32>(0u, 1u, 2u, 3u);
  var distance = vec4<u32>(row_phase[r] + slots - k0 - i) - offsets;
  distance = select(distance, distance - vec4<u32>(slots), distance >= vec4<u32>(slots));
  // (WGSL's & takes unary operands: each comparison in parentheses)
  var sees = (vec4<u32>(i) + offsets < vec4<u32>(keys)) & (distance < vec4<u32>(row_span[r])) &
             (distance <= vec4<u32>(p));
  if (PAD_MASK) {
    let at = select(vec4<u32>(0u), vec4<u32>(p) - distance, sees);
    sees &= vec4<bool>(tokens[at.x] != 0u, tokens[at.y] != 0u, tokens[at.z] != 0u, tokens[at.w] != 0u);
  }
  return sees;
}

// The QK_DIM elements of the key row at word `base`, as quads.
fn key_quads(base: u32) -> array<vec4<f32>, Q_QUADS> {
  var x: array<vec4<f32>, Q_QUADS>;
  for (var w = 0u; w < Q_QUADS; w++) {
    x[w] = quad(base, w, QK_DIM, K_ROW);
  }
  return x;
}

// Index of row r's partial of range `split` (pairs at 2·index, values at acc_at + index·V_DIM).
fn partial_index(r: u32, head0: u32, t0: u32, split: u32) -> u32 {
  return ((t0 + r / HEAD_TILE) * params.heads + head0 + r % HEAD_TILE) * SPLITS + split;
}

// Rows of the tile: their queries, their positions, and span 0 for a row past the chunk or
// the group.
fn load_tile(lid: u32, head0: u32, t0: u32) {
  let heads_here = min(HEAD_TILE, (head0 / GROUP) * GROUP + GROUP - head0);
  for (var i = lid; i < ROWS * Q_QUADS; i += THREADS) {
    let r = i / Q_QUADS;
    let c = i % Q_QUADS;
    let t = t0 + r / HEAD_TILE;
    let h = r % HEAD_TILE;
    var x = vec4<f32>(0.0);
    if (t < params.positions && h < heads_here) {
      let at = t * params.q_stride + (head0 + h) * QK_DIM;
      for (var e = 0u; e < 4u; e++) {
        if (4u * c + e < QK_DIM) {
          x[e] = q[at + 4u * c + e];
        }
      }
    }
    query[i] = x;
  }
  if (lid < ROWS) {
    let t = t0 + lid / HEAD_TILE;
    row_pos[lid] = query_position(t);
    row_phase[lid] = query_position(t) % params.cache_slots;
    row_span[lid] = select(0u, params.span, t < params.positions && lid % HEAD_TILE < heads_here);
    row_max[lid] = LOWEST;
  }
}

@compute @workgroup_size(64)
fn partial(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let split = wg.x;
  let kv = wg.y / HEAD_TILES;
  let head0 = kv * GROUP + (wg.y % HEAD_TILES) * HEAD_TILE;  // first query head of the tile
  let t0 = wg.z * QUERY_TILE;
  if (!taken_here(t0)) {
    return;
  }
  let slots = params.cache_slots;
  let base = cache_base(t0);  // SEQUENCES: one query a tile, so one slot
  let k_at = params.k_at + base;
  let v_at0 = params.v_at + base;
  let k_scale_at = params.k_scale_at + base;
  let v_scale_at = params.v_scale_at + base;
  load_tile(lid, head0, t0);
  workgroupBarrier();
  let seen = tile_slots(t0);

  let g = lid % KEY_GROUPS;  // key group
  let c = lid / KEY_GROUPS;  // value quad (none when c >= V_QUADS: THREADS not a multiple of V_QUADS)
  var acc: array<vec4<f32>, ROWS>;
  for (var r = 0u; r < ROWS; r++) {
    acc[r] = vec4<f32>(0.0);
  }
  var sums: array<f32, ROWS>;  // per row, the sum of this invocation's exponentials
  for (var r = 0u; r < ROWS; r++) {
    sums[r] = 0.0;
  }
  for (var b = 0u; b < SPLIT_BLOCKS; b++) {
    let k0 = (split * SPLIT_BLOCKS + b) * BLOCK;
    if (k0 >= slots) {
      break;
    }
    var keys = min(BLOCK, slots - k0);
    if (!meets(seen, k0, keys)) {
      continue;
    }
    // Slots past the last one the tile sees would only be masked (weight 0, sums unchanged): a
    // short sequence in a long cache reads only its own keys, whatever stale ones follow.
    if (seen.x + seen.y <= slots) {
      keys = min(keys, seen.x + seen.y - k0);
    }
    // 1. Scores of every row for the keys i = 4·lid .. 4·lid + 3 of the block (slots k0 + i):
    //    their K rows are held in registers, so each query quad read serves 4 keys.
    let i = 4u * lid;
    var masks = vec4<u32>(0u);
    if (i < keys) {
      let last = keys - 1u;  // a key past the cache's slots reads the last one's row (masked)
      let k = vec4<u32>(k0 + min(i, last), k0 + min(i + 1u, last), k0 + min(i + 2u, last), k0 + min(i + 3u, last));
      let rows = k * params.kv_heads + kv;
      var k_x = key_quads(k_at + rows.x * K_ROW);
      var k_y = key_quads(k_at + rows.y * K_ROW);
      var k_z = key_quads(k_at + rows.z * K_ROW);
      var k_w = key_quads(k_at + rows.w * K_ROW);
      if (TOUCH_VALUES) {  // a word of each 64-byte line of the 4 keys' V rows, ahead of step 4
        var touched = 0u;
        let v_rows = v_at0 + rows * V_ROW;
        for (var line = 0u; line < V_ROW; line += 16u) {
          touched |= cache[v_rows.x + line] | cache[v_rows.y + line] | cache[v_rows.z + line] | cache[v_rows.w + line];
        }
        masks |= vec4<u32>(touched & params.zero);  // (0: the reads stay, nothing changes)
      }
      var key_scale = vec4<f32>(1.0);
      if (KV_MODE == KV_INT8) {
        key_scale = vec4<f32>(bitcast<f32>(cache[k_scale_at + rows.x]), bitcast<f32>(cache[k_scale_at + rows.y]),
                              bitcast<f32>(cache[k_scale_at + rows.z]), bitcast<f32>(cache[k_scale_at + rows.w]));
        value_scale[lid] = vec4<f32>(bitcast<f32>(cache[v_scale_at + rows.x]), bitcast<f32>(cache[v_scale_at + rows.y]),
                                     bitcast<f32>(cache[v_scale_at + rows.z]), bitcast<f32>(cache[v_scale_at + rows.w]));
      }
      for (var r = 0u; r < ROWS; r++) {
        var dots = vec4<f32>(0.0);
        for (var w = 0u; w < Q_QUADS; w++) {
          let x = query[r * Q_QUADS + w];
          dots += vec4<f32>(dot(x, k_x[w]), dot(x, k_y[w]), dot(x, k_z[w]), dot(x, k_w[w]));
        }
        var score = dots * params.scale;
        if (KV_MODE == KV_INT8) {
          score = (dots * key_scale) * params.scale;
        }
        if (SOFTCAP > 0.0) {  // gemma2: tanh(s · (1 / cap)) · cap, as llama.cpp caps the scores
          score = tanh(score * SOFTCAP_INV) * SOFTCAP;
        }
        let sees = row_sees(r, k0, i, keys);
        masks |= select(vec4<u32>(0u), vec4<u32>(1u << r), sees);
        let top = select(vec4<f32>(LOWEST), score, sees);
        lane_rows[r * THREADS + lid] = max(max(top.x, top.y), max(top.z, top.w));
        scores[r * KEY_QUADS + lid] = score;
      }
    } else {  // no key: only the block max needs this invocation's (none)
      for (var r = 0u; r < ROWS; r++) {
        lane_rows[r * THREADS + lid] = LOWEST;
      }
    }
    workgroupBarrier();
    // 2. The running max of row lid.
    if (lid < ROWS) {
      var block_max = LOWEST;
      for (var l = 0u; l < THREADS; l++) {
        block_max = max(block_max, lane_rows[lid * THREADS + l]);
      }
      let grown = max(row_max[lid], block_max);
      row_rescale[lid] = exp(row_max[lid] - grown);
      row_max[lid] = grown;
    }
    workgroupBarrier();
    // 3. Exponentials of the invocation's keys, and its sums.
    for (var r = 0u; r < ROWS; r++) {
      sums[r] *= row_rescale[r];
    }
    for (var r = 0u; r < ROWS && i < keys; r++) {
      let sees = (masks & vec4<u32>(1u << r)) != vec4<u32>(0u);
      let e = select(vec4<f32>(0.0), exp(scores[r * KEY_QUADS + lid] - row_max[r]), sees);
      scores[r * KEY_QUADS + lid] = e;
      sums[r] += e.x;
      sums[r] += e.y;
      sums[r] += e.z;
      sums[r] += e.w;
    }
    workgroupBarrier();
    // 4. Weighted values: quad c of every row over the key quads ≡ g (mod KEY_GROUPS), each
    //    value read once for all rows (a key past the block's keys has weight 0).
    if (c < V_QUADS) {
      for (var r = 0u; r < ROWS; r++) {
        acc[r] *= row_rescale[r];
      }
      for (var n = g; 4u * n < keys; n += KEY_GROUPS) {
        // the cache rows of keys 4n .. 4n + 3, as step 1 has them
        let rows_n = (k0 + min(4u * n + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(keys - 1u))) * params.kv_heads + kv;
        let v_at = v_at0 + rows_n * V_ROW;
        var v_x = quad(v_at.x, c, V_DIM, V_ROW);
        var v_y = quad(v_at.y, c, V_DIM, V_ROW);
        var v_z = quad(v_at.z, c, V_DIM, V_ROW);
        var v_w = quad(v_at.w, c, V_DIM, V_ROW);
        if (KV_MODE == KV_INT8) {
          let v_scale = value_scale[n];
          v_x *= v_scale.x;
          v_y *= v_scale.y;
          v_z *= v_scale.z;
          v_w *= v_scale.w;
        }
        for (var r = 0u; r < ROWS; r++) {
          let e = scores[r * KEY_QUADS + n];
          acc[r] += e.x * v_x;
          acc[r] += e.y * v_y;
          acc[r] += e.z * v_z;
          acc[r] += e.w * v_w;
        }
      }
    }
    workgroupBarrier();
  }

  // The key groups' sums, added in group order: scores holds [ROWS][KEY_GROUPS][V_QUADS] quads.
  if (c < V_QUADS) {
    for (var r = 0u; r < ROWS; r++) {
      scores[(r * KEY_GROUPS + g) * V_QUADS + c] = acc[r];
    }
  }
  for (var r = 0u; r < ROWS; r++) {
    lane_rows[r * THREADS + lid] = sums[r];
  }
  workgroupBarrier();
  if (lid < ROWS) {
    var sum = 0.0;  // the invocations' sums, in invocation order
    for (var l = 0u; l < THREADS; l++) {
      sum += lane_rows[lid * THREADS + l];
    }
    row_sum[lid] = sum;
  }
  workgroupBarrier();
  for (var r = 0u; r < ROWS; r++) {
    if (row_span[r] == 0u) {
      continue;
    }
    let at = partial_index(r, head0, t0, split);
    if (SPLITS > 1u && lid == 0u) {
      partials[2u * at] = row_max[r];
      partials[2u * at + 1u] = row_sum[r];
    }
    for (var j = lid; j < V_DIM; j += THREADS) {
      var total = 0.0;
      for (var k = 0u; k < KEY_GROUPS; k++) {
        total += scores[(r * KEY_GROUPS + k) * V_QUADS + j / 4u][j % 4u];
      }
      if (SPLITS > 1u) {
        partials[params.acc_at + at * V_DIM + j] = total;
      } else {
        finish(t0 + r / HEAD_TILE, head0 + r % HEAD_TILE, j, total, row_sum[r]);
      }
    }
  }
}

// o[t][hq·vd + j] = total / sum, gated (0 when a PAD_MASK row sees no key).
fn finish(t: u32, hq: u32, j: u32, total: f32, sum: f32) {
  var attended = total * (1.0 / sum);
  if (PAD_MASK && sum == 0.0) {
    attended = 0.0;
  }
  if (GATE) {
    let gate = gates[t * params.gate_stride + params.gate_offset + hq * V_DIM + j];
    attended *= 1.0 / (1.0 + exp(-gate));
  }
  o[t * params.o_stride + hq * V_DIM + j] = attended;
}

@compute @workgroup_size(64)
fn merge(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let hq = wg.x;
  let t = wg.y;
  if (!taken_here(t)) {
    return;
  }
  let at = (t * params.heads + hq) * SPLITS;
  var top = LOWEST;
  for (var s = 0u; s < SPLITS; s++) {
    top = max(top, partials[2u * (at + s)]);
  }
  var weight: array<f32, SPLITS>;
  var sum = 0.0;
  for (var s = 0u; s < SPLITS; s++) {
    weight[s] = exp(partials[2u * (at + s)] - top);
    sum += partials[2u * (at + s) + 1u] * weight[s];
  }
  for (var j = lid; j < V_DIM; j += THREADS) {
    var total = 0.0;
    for (var s = 0u; s < SPLITS; s++) {
      total += partials[params.acc_at + (at + s) * V_DIM + j] * weight[s];
    }
    finish(t, hq, j, total, sum);
  }
}
