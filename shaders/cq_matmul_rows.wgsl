// CQ dequant-matmul, row-per-invocation variant for software rasterisers (spec §5.5).
//
// Same product and parameters as cq_matmul.wgsl, shaped for CPU back ends (lavapipe,
// SwiftShader), which run a workgroup on one thread and vectorise across invocations: no
// workgroup memory, no barriers, vec4 loads, and code -> level mapping with vector selects
// instead of table gathers. Each invocation computes ROWS rows (4; 1 with BLOCKED) for TT (1, 4
// or 8) positions, decoding every code word once for all positions and reading every
// activation quad once for all rows (on a CPU those loads set the pace); each (row, position)
// is summed in the same order whatever ROWS and TT, so a position has the same bits in any
// chunk or batch. 2- and 4-bit codes (and ternary crumbs); 3-bit files use cq_matmul.wgsl.
//
// Constants: CODE_BITS (2 or 4), LEVEL_BASE, TT (1, 4 or 8), ROWS, GROUPS (groups per row),
// GROUP_CHUNKS (32-code chunks per group), BLOCKED (rows read per-block inputs). Loop bounds and branches
// are constants, never uniform values: lavapipe recompiles a shader at every dispatch whose
// control flow depends on uniform values alone.

struct Params {
  rows: u32,
  row_start: u32,
  row_words: u32,
  groups: u32,
  norm_base: u32,
  group_chunks: u32,
  positions: u32,
  x_stride: u32,
  x_offset: u32,
  x_block_rows: u32,
  x_block_stride: u32,
  y_stride: u32,
  y_offset: u32,
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> levels: array<f32>;
@group(0) @binding(3) var<storage, read> xh: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

//#include include/tile_offsets.wgsl

const QUADS: u32 = 8u / CODE_BITS;  // groups of 4 codes per u32 word

var<private> level_quads: array<vec4<f32>, 4>;

fn word_at(index: u32) -> u32 {
  let quad = weights[index >> 2u];
  return quad[index & 3u];
}

fn norm_of(row: u32, group: u32) -> f32 {
  let index = row * params.groups + group;
  let pair = unpack2x16float(word_at(params.norm_base + (index >> 1u)));
  return select(pair.x, pair.y, (index & 1u) == 1u);
}

fn pick4(q: vec4<f32>, c: vec4<u32>) -> vec4<f32> {
  let low = select(vec4<f32>(q.x), vec4<f32>(q.y), c == vec4<u32>(1u));
  let high = select(vec4<f32>(q.z), vec4<f32>(q.w), c == vec4<u32>(3u));
  return select(low, high, c >= vec4<u32>(2u));
}

// Levels of the four codes of `word` starting at code index 4q.
fn levels_of(word: u32, q: u32) -> vec4<f32> {
  let shift = q * 4u * CODE_BITS;
  let shifts = vec4<u32>(shift, shift + CODE_BITS, shift + 2u * CODE_BITS, shift + 3u * CODE_BITS);
  let c = (vec4<u32>(word) >> shifts) & vec4<u32>((1u << CODE_BITS) - 1u);
  if (CODE_BITS == 2u) {
    return pick4(level_quads[0], c);
  }
  let low = c & vec4<u32>(3u);
  let high = c >> vec4<u32>(2u);
  let l0 = pick4(level_quads[0], low);
  let l1 = pick4(level_quads[1], low);
  let l2 = pick4(level_quads[2], low);
  let l3 = pick4(level_quads[3], low);
  return select(select(l0, l1, high == vec4<u32>(1u)), select(l2, l3, high == vec4<u32>(3u)), high >= vec4<u32>(2u));
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let first = gid.x * ROWS;  // the invocation's first local row
  if (first >= params.rows) {
    return;
  }
  for (var k = 0u; k < 4u; k++) {
    let b = LEVEL_BASE + 4u * k;
    level_quads[k] = vec4<f32>(levels[b], levels[b + 1u], levels[b + 2u], levels[b + 3u]);
  }
  // Rows past the end recompute the last row (always valid) and are not stored.
  var row: array<u32, ROWS>;
  for (var r = 0u; r < ROWS; r++) {
    row[r] = params.row_start + min(first + r, params.rows - 1u);
  }
  let t0 = gid.y * TT;
  let tile = min(TT, params.positions - t0);
  var x_base = params.x_offset + t0 * params.x_stride;
  if (BLOCKED) {  // ROWS is 1: a row's block decides its input
    x_base += (first / params.x_block_rows) * params.x_block_stride;
  }
  let at = tile_offsets(params.x_stride >> 2u, tile);  // position j at x[xi + at.pj]
  let words_per_group = GROUP_CHUNKS * CODE_BITS;
  var acc: array<vec4<f32>, ROWS>;
  var acc_hi: array<vec4<f32>, ROWS>;  // positions 4..7 when TT = 8
  for (var r = 0u; r < ROWS; r++) {
    acc[r] = vec4<f32>(0.0);
    acc_hi[r] = vec4<f32>(0.0);
  }
  for (var g = 0u; g < GROUPS; g++) {
    var sums: array<vec4<f32>, ROWS>;
    var sums_hi: array<vec4<f32>, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
      sums[r] = vec4<f32>(0.0);
      sums_hi[r] = vec4<f32>(0.0);
    }
    let x0 = (x_base >> 2u) + g * GROUP_CHUNKS * 8u;
    for (var w = 0u; w < words_per_group; w++) {
      var words: array<u32, ROWS>;
      for (var r = 0u; r < ROWS; r++) {
        words[r] = word_at(row[r] * params.row_words + g * words_per_group + w);
      }
      for (var q = 0u; q < QUADS; q++) {
        let xi = x0 + w * QUADS + q;
        // Each activation quad is read once for the ROWS rows (what the loads cost on a CPU).
        let a0 = xh[xi];
        var a1 = a0;
        var a2 = a0;
        var a3 = a0;
        if (TT > 1u) {
          a1 = xh[xi + at.p1];
          a2 = xh[xi + at.p2];
          a3 = xh[xi + at.p3];
        }
        var a4 = a0;
        var a5 = a0;
        var a6 = a0;
        var a7 = a0;
        if (TT == 8u) {
          a4 = xh[xi + at.p4];
          a5 = xh[xi + at.p5];
          a6 = xh[xi + at.p6];
          a7 = xh[xi + at.p7];
        }
        for (var r = 0u; r < ROWS; r++) {
          let level = levels_of(words[r], q);
          if (TT == 1u) {
            sums[r].x += dot(level, a0);
          } else {
            sums[r] += vec4<f32>(dot(level, a0), dot(level, a1), dot(level, a2), dot(level, a3));
            if (TT == 8u) {
              sums_hi[r] += vec4<f32>(dot(level, a4), dot(level, a5), dot(level, a6), dot(level, a7));
            }
          }
        }
      }
    }
    for (var r = 0u; r < ROWS; r++) {
      let norm = norm_of(row[r], g);
      acc[r] += norm * sums[r];
      acc_hi[r] += norm * sums_hi[r];
    }
  }
  for (var r = 0u; r < ROWS; r++) {
    let local_row = first + r;
    if (local_row < params.rows) {
      let out = params.y_offset + t0 * params.y_stride + local_row;
      let a = acc[r];
      let b = acc_hi[r];
      y[out] = a.x;
      if (tile > 1u) { y[out + params.y_stride] = a.y; }
      if (tile > 2u) { y[out + 2u * params.y_stride] = a.z; }
      if (tile > 3u) { y[out + 3u * params.y_stride] = a.w; }
      if (tile > 4u) { y[out + 4u * params.y_stride] = b.x; }
      if (tile > 5u) { y[out + 5u * params.y_stride] = b.y; }
      if (tile > 6u) { y[out + 6u * params.y_stride] = b.z; }
      if (tile > 7u) { y[out + 7u * params.y_stride] = b.w; }
    }
  }
}
