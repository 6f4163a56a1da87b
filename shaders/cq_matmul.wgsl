// CQ dequant-matmul against a prepared activation (spec §5.5).
//
//   y[t, o] = sum_g norm[o, g] * sum_m level[code(o, gG + m)] * xh[t, gG + m]
//
// xh is the activation after the per-group normalised Walsh-Hadamard transform (cq_prepare),
// so the weights are never reconstructed. One workgroup computes ROWS rows for a tile of TT
// positions: each lane decodes a chunk of 32 codes once and applies it to every position of
// the tile (TT = 1 is the decode GEMV, TT > 1 the chunked prefill GEMM).
//
// Constants prepended by the device layer (KernelKey.consts):
//   CODE_BITS  bits per stored code (2, 3, 4; ternary records use 2-bit crumbs)
//   LEVEL_BASE offset of this width's level table in `levels`
//   TT         positions per workgroup tile
//   ROWS       rows per workgroup (x 32 lanes = workgroup size)
//
// Weight buffer layout (a "pack": one or more CQ tensors with the same in-width, group and
// width, concatenated along rows): all packed code rows first, then all FP16 norms.

struct Params {
  rows: u32,          // rows computed by this dispatch
  row_start: u32,     // first pack row (bands of the mHC phi matrices, split tensors)
  row_words: u32,     // u32 words of codes per row
  groups: u32,        // groups per row (in_pad / G)
  norm_base: u32,     // word index of the first FP16 norm pair
  group_chunks: u32,  // 32-code chunks per group (G / 32)
  positions: u32,     // T
  x_stride: u32,      // floats between positions in xh
  x_offset: u32,      // float offset of position 0 in xh
  x_block_rows: u32,  // rows that share one input block (0: all rows share one input)
  x_block_stride: u32,// floats between input blocks
  y_stride: u32,      // floats between positions in y
  y_offset: u32,      // float offset of row 0, position 0 in y
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> weights: array<u32>;
@group(0) @binding(2) var<storage, read> levels: array<f32>;
@group(0) @binding(3) var<storage, read> xh: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const LANES: u32 = 32u;
const LEVEL_COUNT: u32 = 1u << CODE_BITS;
const MASK: u32 = LEVEL_COUNT - 1u;
// Codes per u32 word when fields never straddle words (2 and 4 bits); 3-bit takes its own path.
const PER_WORD: u32 = 32u / CODE_BITS;

var<workgroup> level_table: array<f32, 16>;
var<workgroup> partial: array<f32, 256 * TT>;

fn norm_of(row: u32, group: u32) -> f32 {
  let index = row * params.groups + group;
  let pair = unpack2x16float(weights[params.norm_base + (index >> 1u)]);
  return select(pair.x, pair.y, (index & 1u) == 1u);
}

// The 3-bit code e (0..31) of a chunk held in three words (fields may straddle two words).
fn code3(w0: u32, w1: u32, w2: u32, e: u32) -> u32 {
  let bit = e * 3u;
  let word = bit >> 5u;
  let shift = bit & 31u;
  let lo = select(select(w2, w1, word == 1u), w0, word == 0u);
  let hi = select(w2, w1, word == 0u);
  var field = lo >> shift;
  if (shift > 29u) {
    field |= hi << (32u - shift);
  }
  return field & 7u;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  if (lid < LEVEL_COUNT) {
    level_table[lid] = levels[LEVEL_BASE + lid];
  }
  workgroupBarrier();

  let lane = lid % LANES;
  let local_row = wg.x * ROWS + lid / LANES;
  let row_in_range = local_row < params.rows;
  let row = params.row_start + local_row;
  let t0 = wg.y * TT;
  let tile = min(TT, params.positions - t0);
  let chunks = params.groups * params.group_chunks;

  var x_base = params.x_offset + t0 * params.x_stride;
  if (params.x_block_rows > 0u) {
    x_base += (local_row / params.x_block_rows) * params.x_block_stride;
  }

  // acc[t] += norm * sum(level * xh[t]) over this lane's 32-code chunks. Each chunk's codes are
  // decoded once and applied to every position of the tile (the "decode once per chunk" GEMM).
  var acc: array<f32, TT>;
  if (row_in_range) {
    for (var chunk = lane; chunk < chunks; chunk += LANES) {
      let word0 = row * params.row_words + chunk * CODE_BITS;
      let column = x_base + chunk * 32u;
      var sums: array<f32, TT>;
      if (CODE_BITS == 3u) {
        let w0 = weights[word0];
        let w1 = weights[word0 + 1u];
        let w2 = weights[word0 + 2u];
        for (var e = 0u; e < 32u; e++) {
          let level = level_table[code3(w0, w1, w2, e)];
          for (var t = 0u; t < TT; t++) {
            if (t < tile) {
              sums[t] += level * xh[column + t * params.x_stride + e];
            }
          }
        }
      } else {
        for (var w = 0u; w < CODE_BITS; w++) {
          let word = weights[word0 + w];
          let first = column + w * PER_WORD;
          for (var k = 0u; k < PER_WORD; k++) {
            let level = level_table[(word >> (k * CODE_BITS)) & MASK];
            for (var t = 0u; t < TT; t++) {
              if (t < tile) {
                sums[t] += level * xh[first + t * params.x_stride + k];
              }
            }
          }
        }
      }
      let norm = norm_of(row, chunk / params.group_chunks);
      for (var t = 0u; t < TT; t++) {
        acc[t] += norm * sums[t];
      }
    }
  }

  // One barrier: every lane's partial sums go to workgroup memory, then one invocation per
  // (row, position) adds its row's LANES partials in order.
  for (var t = 0u; t < TT; t++) {
    partial[t * 256u + lid] = acc[t];
  }
  workgroupBarrier();
  if (lid < ROWS * TT) {
    let r = lid / TT;
    let t = lid % TT;
    let out_row = wg.x * ROWS + r;
    if (out_row < params.rows && t < tile) {
      var total = 0.0;
      for (var l = 0u; l < LANES; l++) {
        total += partial[t * 256u + r * LANES + l];
      }
      y[params.y_offset + (t0 + t) * params.y_stride + out_row] = total;
    }
  }
}

