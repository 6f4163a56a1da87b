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

var<workgroup> level_table: array<f32, 16>;
var<workgroup> partial: array<f32, 256>;

fn norm_of(row: u32, group: u32) -> f32 {
  let index = row * params.groups + group;
  let pair = unpack2x16float(weights[params.norm_base + (index >> 1u)]);
  return select(pair.x, pair.y, (index & 1u) == 1u);
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
  let chunks = params.groups * params.group_chunks;

  var x_base = params.x_offset;
  if (params.x_block_rows > 0u) {
    x_base += (local_row / params.x_block_rows) * params.x_block_stride;
  }

  var acc: array<f32, TT>;
  if (row_in_range) {
    for (var chunk = lane; chunk < chunks; chunk += LANES) {
      // Decode 32 codes once (CODE_BITS words, LSB-first bitstream, §5.2).
      var words: array<u32, 4>;
      let word0 = row * params.row_words + chunk * CODE_BITS;
      for (var i = 0u; i < CODE_BITS; i++) {
        words[i] = weights[word0 + i];
      }
      var w: array<f32, 32>;
      for (var e = 0u; e < 32u; e++) {
        let bit = e * CODE_BITS;
        let word = bit >> 5u;
        let shift = bit & 31u;
        var field = words[word] >> shift;
        if (shift + CODE_BITS > 32u) {
          field |= words[word + 1u] << (32u - shift);
        }
        w[e] = level_table[field & (LEVEL_COUNT - 1u)];
      }
      let norm = norm_of(row, chunk / params.group_chunks);
      let column = chunk * 32u;
      for (var t = 0u; t < TT; t++) {
        let position = t0 + t;
        if (position < params.positions) {
          let x0 = x_base + position * params.x_stride + column;
          var s = 0.0;
          for (var e = 0u; e < 32u; e++) {
            s += w[e] * xh[x0 + e];
          }
          acc[t] += norm * s;
        }
      }
    }
  }

  // Reduce the 32 lanes of each row, one position at a time.
  for (var t = 0u; t < TT; t++) {
    partial[lid] = acc[t];
    workgroupBarrier();
    for (var step = LANES / 2u; step > 0u; step >>= 1u) {
      if (lane < step) {
        partial[lid] += partial[lid + step];
      }
      workgroupBarrier();
    }
    let position = t0 + t;
    if (row_in_range && lane == 0u && position < params.positions) {
      y[params.y_offset + position * params.y_stride + local_row] = partial[lid];
    }
    workgroupBarrier();
  }
}
