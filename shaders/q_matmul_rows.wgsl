// GGUF dequant-matmul, CPU-adapter shape (dense-gguf spec §8): whole rows per invocation.
//
//   y[y_offset + t * y_stride + o] (+)= sum_i W[row0 + o, i] * x[x_offset + t * x_stride + i]
//
// For lavapipe and SwiftShader, which run a workgroup on one CPU thread and vectorise across its
// invocations: no workgroup memory, barriers or subgroups; u32 weight loads, vec4 activation
// loads, f32 accumulators. Each invocation computes ROWS (4) rows for TT positions (1: the decode
// GEMV; 8: the prefill GEMM), decoding every scale once per sub-block and every weight quad once
// for all positions. Four rows rather than the spec's one: every invocation loads the same
// activations, and on lavapipe (Mesa 22.3) those loads, not the weights, set the pace (an
// 8-position GEMM with one row per invocation was no faster than eight GEMVs); four rows share
// each activation quad (576 x 1536 on 2 busy cores: T = 8 2.6-3x, GEMV 1.2-1.6x faster). Loop
// bounds and branches are constants (lavapipe recompiles shaders whose control flow depends on
// uniforms).
//
// Entry ``split`` (a batch of decode steps, one position per sequence: q_matmul's gemm=False
// over several positions): each position is summed exactly as the TT = 1 GEMV sums its one
// position (four partial sums per row, the same products added in the same order, added up the
// same way at the end), so a sequence's row has the same bits in a batch as alone, while each
// weight is still decoded once for all the tile's positions.
//
// Constants: QTYPE, BLOCK_WORDS, BLOCK_QUADS, SUB_QUADS, ROW_BLOCKS (GPU blocks per row), TT,
// ACCUMULATE.
// Bindings: 0 params, 1 one part of the pack (word plane, then side plane), 2 x f32, 3 y f32.
// Workgroups: (ceil(rows / 256) folded as x + z * num_workgroups.x, ceil(positions / TT)).

//#include include/q_matmul_io.wgsl
//#include include/gguf_blocks.wgsl
//#include include/tile_offsets.wgsl

const ROWS: u32 = 4u;  // rows per invocation

fn store(index: u32, value: f32) {
  if (ACCUMULATE) {
    y[index] += value;
  } else {
    y[index] = value;
  }
}

// Four dot products of one weight quad with the quads of four positions.
fn dots4(w: vec4<f32>, a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32>) -> vec4<f32> {
  return vec4<f32>(dot(w, a), dot(w, b), dot(w, c), dot(w, d));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let local_row = ((wg.x + wg.z * groups.x) * 64u + lid) * ROWS;
  if (local_row >= params.rows) {
    return;
  }
  // Rows past the end recompute the last row (always valid) and are not stored.
  let last = params.rows - 1u;
  let row0 = params.row0 + local_row;
  let row1 = params.row0 + min(local_row + 1u, last);
  let row2 = params.row0 + min(local_row + 2u, last);
  let row3 = params.row0 + min(local_row + 3u, last);
  let t0 = wg.y * TT;
  let tile = min(TT, params.positions - t0);
  let at = tile_offsets(params.x_stride >> 2u, tile);  // position j at x[xi + at.pj]
  let x_base = (params.x_offset + t0 * params.x_stride) >> 2u;

  // a_r: row r, positions 0..3 (TT = 1: four partial sums of position 0); b_r: positions 4..7.
  var a0 = vec4<f32>(0.0);
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  var b0 = vec4<f32>(0.0);
  var b1 = vec4<f32>(0.0);
  var b2 = vec4<f32>(0.0);
  var b3 = vec4<f32>(0.0);
  for (var b = 0u; b < ROW_BLOCKS; b++) {
    let block0 = row0 * ROW_BLOCKS + b;
    let block1 = row1 * ROW_BLOCKS + b;
    let block2 = row2 * ROW_BLOCKS + b;
    let block3 = row3 * ROW_BLOCKS + b;
    for (var s = 0u; s < BLOCK_QUADS / SUB_QUADS; s++) {
      // Scales decoded once per sub-block.
      let k0 = sub_scale(block0, s);
      let k1 = sub_scale(block1, s);
      let k2 = sub_scale(block2, s);
      let k3 = sub_scale(block3, s);
      let xs = x_base + b * BLOCK_QUADS + s * SUB_QUADS;
      for (var jj = 0u; jj < SUB_QUADS; jj++) {
        let xi = xs + jj;
        let x0 = x[xi];
        let w0 = k0.x * sub_quad(block0, s, jj) + k0.y;
        let w1 = k1.x * sub_quad(block1, s, jj) + k1.y;
        let w2 = k2.x * sub_quad(block2, s, jj) + k2.y;
        let w3 = k3.x * sub_quad(block3, s, jj) + k3.y;
        if (TT == 1u) {
          a0 += w0 * x0;
          a1 += w1 * x0;
          a2 += w2 * x0;
          a3 += w3 * x0;
        } else {
          let x1 = x[xi + at.p1];
          let x2 = x[xi + at.p2];
          let x3 = x[xi + at.p3];
          a0 += dots4(w0, x0, x1, x2, x3);
          a1 += dots4(w1, x0, x1, x2, x3);
          a2 += dots4(w2, x0, x1, x2, x3);
          a3 += dots4(w3, x0, x1, x2, x3);
          if (TT == 8u) {
            let x4 = x[xi + at.p4];
            let x5 = x[xi + at.p5];
            let x6 = x[xi + at.p6];
            let x7 = x[xi + at.p7];
            b0 += dots4(w0, x4, x5, x6, x7);
            b1 += dots4(w1, x4, x5, x6, x7);
            b2 += dots4(w2, x4, x5, x6, x7);
            b3 += dots4(w3, x4, x5, x6, x7);
          }
        }
      }
    }
  }

  store_rows(local_row, t0, tile, a0, b0);
  if (local_row + 1u < params.rows) { store_rows(local_row + 1u, t0, tile, a1, b1); }
  if (local_row + 2u < params.rows) { store_rows(local_row + 2u, t0, tile, a2, b2); }
  if (local_row + 3u < params.rows) { store_rows(local_row + 3u, t0, tile, a3, b3); }
}

// Stores one row's sums: TT = 1: the four partial sums of `a` added; else positions 0..3 from
// `a` and 4..7 from `b`, those inside the tile.
fn store_rows(local_row: u32, t0: u32, tile: u32, a: vec4<f32>, b: vec4<f32>) {
  let out = params.y_offset + t0 * params.y_stride + local_row;
  if (TT == 1u) {
    store(out, (a.x + a.y) + (a.z + a.w));
    return;
  }
  store(out, a.x);
  if (tile > 1u) { store(out + params.y_stride, a.y); }
  if (tile > 2u) { store(out + 2u * params.y_stride, a.z); }
  if (tile > 3u) { store(out + 3u * params.y_stride, a.w); }
  if (tile > 4u) { store(out + 4u * params.y_stride, b.x); }
  if (tile > 5u) { store(out + 5u * params.y_stride, b.y); }
  if (tile > 6u) { store(out + 6u * params.y_stride, b.z); }
  if (tile > 7u) { store(out + 7u * params.y_stride, b.w); }
}

// Entry ``split``: SPLIT_ROWS (16) rows per invocation and TT (4 or 8) positions, every position
// summed as the one-position GEMV sums it: each activation quad is read once for 16 rows, each
// weight decoded once for the TT positions. 16 x 8 keeps 128 partial-sum quads, most of them
// spilled to the stack, yet on lavapipe a weight decode and an activation load cost more than
// those spills, so the larger tile pays (8 positions of Q4_1 576 x 1536 on 2 busy cores, over
// one position: 4 rows x 8 positions 2.8x, 8 x 8 2.4x, 16 x 8 2.15x, 24 x 8 2.5x). Sixteen
// invocations a workgroup (256 rows, as ``main``) give 576 rows three workgroups for lavapipe's
// threads.
const SPLIT_ROWS: u32 = 16u;

@compute @workgroup_size(16)
fn split(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
  let local_row = ((wg.x + wg.z * groups.x) * 16u + lid) * SPLIT_ROWS;
  if (local_row >= params.rows) {
    return;
  }
  let last = params.rows - 1u;
  let row0 = params.row0 + min(local_row + 0u, last);
  let row1 = params.row0 + min(local_row + 1u, last);
  let row2 = params.row0 + min(local_row + 2u, last);
  let row3 = params.row0 + min(local_row + 3u, last);
  let row4 = params.row0 + min(local_row + 4u, last);
  let row5 = params.row0 + min(local_row + 5u, last);
  let row6 = params.row0 + min(local_row + 6u, last);
  let row7 = params.row0 + min(local_row + 7u, last);
  let row8 = params.row0 + min(local_row + 8u, last);
  let row9 = params.row0 + min(local_row + 9u, last);
  let row10 = params.row0 + min(local_row + 10u, last);
  let row11 = params.row0 + min(local_row + 11u, last);
  let row12 = params.row0 + min(local_row + 12u, last);
  let row13 = params.row0 + min(local_row + 13u, last);
  let row14 = params.row0 + min(local_row + 14u, last);
  let row15 = params.row0 + min(local_row + 15u, last);
  let t0 = wg.y * TT;
  let tile = min(TT, params.positions - t0);
  let at = tile_offsets(params.x_stride >> 2u, tile);
  let x_base = (params.x_offset + t0 * params.x_stride) >> 2u;
  var sp: array<vec4<f32>, 128>;  // sp[8 r + j]: row r, position j (constant indices only)
  for (var b = 0u; b < ROW_BLOCKS; b++) {
    let block0 = row0 * ROW_BLOCKS + b;
    let block1 = row1 * ROW_BLOCKS + b;
    let block2 = row2 * ROW_BLOCKS + b;
    let block3 = row3 * ROW_BLOCKS + b;
    let block4 = row4 * ROW_BLOCKS + b;
    let block5 = row5 * ROW_BLOCKS + b;
    let block6 = row6 * ROW_BLOCKS + b;
    let block7 = row7 * ROW_BLOCKS + b;
    let block8 = row8 * ROW_BLOCKS + b;
    let block9 = row9 * ROW_BLOCKS + b;
    let block10 = row10 * ROW_BLOCKS + b;
    let block11 = row11 * ROW_BLOCKS + b;
    let block12 = row12 * ROW_BLOCKS + b;
    let block13 = row13 * ROW_BLOCKS + b;
    let block14 = row14 * ROW_BLOCKS + b;
    let block15 = row15 * ROW_BLOCKS + b;
    for (var s = 0u; s < BLOCK_QUADS / SUB_QUADS; s++) {
      let k0 = sub_scale(block0, s);
      let k1 = sub_scale(block1, s);
      let k2 = sub_scale(block2, s);
      let k3 = sub_scale(block3, s);
      let k4 = sub_scale(block4, s);
      let k5 = sub_scale(block5, s);
      let k6 = sub_scale(block6, s);
      let k7 = sub_scale(block7, s);
      let k8 = sub_scale(block8, s);
      let k9 = sub_scale(block9, s);
      let k10 = sub_scale(block10, s);
      let k11 = sub_scale(block11, s);
      let k12 = sub_scale(block12, s);
      let k13 = sub_scale(block13, s);
      let k14 = sub_scale(block14, s);
      let k15 = sub_scale(block15, s);
      let xs = x_base + b * BLOCK_QUADS + s * SUB_QUADS;
      for (var jj = 0u; jj < SUB_QUADS; jj++) {
        let xi = xs + jj;
        let x0 = x[xi];
        let x1 = x[xi + at.p1];
        let x2 = x[xi + at.p2];
        let x3 = x[xi + at.p3];
        var x4 = x0;
        var x5 = x0;
        var x6 = x0;
        var x7 = x0;
        if (TT == 8u) {
          x4 = x[xi + at.p4];
          x5 = x[xi + at.p5];
          x6 = x[xi + at.p6];
          x7 = x[xi + at.p7];
        }
        let w0 = k0.x * sub_quad(block0, s, jj) + k0.y;
        sp[0u] += w0 * x0; sp[1u] += w0 * x1; sp[2u] += w0 * x2; sp[3u] += w0 * x3;
        if (TT == 8u) { sp[4u] += w0 * x4; sp[5u] += w0 * x5; sp[6u] += w0 * x6; sp[7u] += w0 * x7; }
        let w1 = k1.x * sub_quad(block1, s, jj) + k1.y;
        sp[8u] += w1 * x0; sp[9u] += w1 * x1; sp[10u] += w1 * x2; sp[11u] += w1 * x3;
        if (TT == 8u) { sp[12u] += w1 * x4; sp[13u] += w1 * x5; sp[14u] += w1 * x6; sp[15u] += w1 * x7; }
        let w2 = k2.x * sub_quad(block2, s, jj) + k2.y;
        sp[16u] += w2 * x0; sp[17u] += w2 * x1; sp[18u] += w2 * x2; sp[19u] += w2 * x3;
        if (TT == 8u) { sp[20u] += w2 * x4; sp[21u] += w2 * x5; sp[22u] += w2 * x6; sp[23u] += w2 * x7; }
        let w3 = k3.x * sub_quad(block3, s, jj) + k3.y;
        sp[24u] += w3 * x0; sp[25u] += w3 * x1; sp[26u] += w3 * x2; sp[27u] += w3 * x3;
        if (TT == 8u) { sp[28u] += w3 * x4; sp[29u] += w3 * x5; sp[30u] += w3 * x6; sp[31u] += w3 * x7; }
        let w4 = k4.x * sub_quad(block4, s, jj) + k4.y;
        sp[32u] += w4 * x0; sp[33u] += w4 * x1; sp[34u] += w4 * x2; sp[35u] += w4 * x3;
        if (TT == 8u) { sp[36u] += w4 * x4; sp[37u] += w4 * x5; sp[38u] += w4 * x6; sp[39u] += w4 * x7; }
        let w5 = k5.x * sub_quad(block5, s, jj) + k5.y;
        sp[40u] += w5 * x0; sp[41u] += w5 * x1; sp[42u] += w5 * x2; sp[43u] += w5 * x3;
        if (TT == 8u) { sp[44u] += w5 * x4; sp[45u] += w5 * x5; sp[46u] += w5 * x6; sp[47u] += w5 * x7; }
        let w6 = k6.x * sub_quad(block6, s, jj) + k6.y;
        sp[48u] += w6 * x0; sp[49u] += w6 * x1; sp[50u] += w6 * x2; sp[51u] += w6 * x3;
        if (TT == 8u) { sp[52u] += w6 * x4; sp[53u] += w6 * x5; sp[54u] += w6 * x6; sp[55u] += w6 * x7; }
        let w7 = k7.x * sub_quad(block7, s, jj) + k7.y;
        sp[56u] += w7 * x0; sp[57u] += w7 * x1; sp[58u] += w7 * x2; sp[59u] += w7 * x3;
        if (TT == 8u) { sp[60u] += w7 * x4; sp[61u] += w7 * x5; sp[62u] += w7 * x6; sp[63u] += w7 * x7; }
        let w8 = k8.x * sub_quad(block8, s, jj) + k8.y;
        sp[64u] += w8 * x0; sp[65u] += w8 * x1; sp[66u] += w8 * x2; sp[67u] += w8 * x3;
        if (TT == 8u) { sp[68u] += w8 * x4; sp[69u] += w8 * x5; sp[70u] += w8 * x6; sp[71u] += w8 * x7; }
        let w9 = k9.x * sub_quad(block9, s, jj) + k9.y;
        sp[72u] += w9 * x0; sp[73u] += w9 * x1; sp[74u] += w9 * x2; sp[75u] += w9 * x3;
        if (TT == 8u) { sp[76u] += w9 * x4; sp[77u] += w9 * x5; sp[78u] += w9 * x6; sp[79u] += w9 * x7; }
        let w10 = k10.x * sub_quad(block10, s, jj) + k10.y;
        sp[80u] += w10 * x0; sp[81u] += w10 * x1; sp[82u] += w10 * x2; sp[83u] += w10 * x3;
        if (TT == 8u) { sp[84u] += w10 * x4; sp[85u] += w10 * x5; sp[86u] += w10 * x6; sp[87u] += w10 * x7; }
        let w11 = k11.x * sub_quad(block11, s, jj) + k11.y;
        sp[88u] += w11 * x0; sp[89u] += w11 * x1; sp[90u] += w11 * x2; sp[91u] += w11 * x3;
        if (TT == 8u) { sp[92u] += w11 * x4; sp[93u] += w11 * x5; sp[94u] += w11 * x6; sp[95u] += w11 * x7; }
        let w12 = k12.x * sub_quad(block12, s, jj) + k12.y;
        sp[96u] += w12 * x0; sp[97u] += w12 * x1; sp[98u] += w12 * x2; sp[99u] += w12 * x3;
        if (TT == 8u) { sp[100u] += w12 * x4; sp[101u] += w12 * x5; sp[102u] += w12 * x6; sp[103u] += w12 * x7; }
        let w13 = k13.x * sub_quad(block13, s, jj) + k13.y;
        sp[104u] += w13 * x0; sp[105u] += w13 * x1; sp[106u] += w13 * x2; sp[107u] += w13 * x3;
        if (TT == 8u) { sp[108u] += w13 * x4; sp[109u] += w13 * x5; sp[110u] += w13 * x6; sp[111u] += w13 * x7; }
        let w14 = k14.x * sub_quad(block14, s, jj) + k14.y;
        sp[112u] += w14 * x0; sp[113u] += w14 * x1; sp[114u] += w14 * x2; sp[115u] += w14 * x3;
        if (TT == 8u) { sp[116u] += w14 * x4; sp[117u] += w14 * x5; sp[118u] += w14 * x6; sp[119u] += w14 * x7; }
        let w15 = k15.x * sub_quad(block15, s, jj) + k15.y;
        sp[120u] += w15 * x0; sp[121u] += w15 * x1; sp[122u] += w15 * x2; sp[123u] += w15 * x3;
        if (TT == 8u) { sp[124u] += w15 * x4; sp[125u] += w15 * x5; sp[126u] += w15 * x6; sp[127u] += w15 * x7; }
      }
    }
  }
  let out = params.y_offset + t0 * params.y_stride + local_row;
  if (local_row + 0u < params.rows) {
    store_split(out + 0u, tile, sp[0u], sp[1u], sp[2u], sp[3u], sp[4u], sp[5u], sp[6u], sp[7u]);
  }
  if (local_row + 1u < params.rows) {
    store_split(out + 1u, tile, sp[8u], sp[9u], sp[10u], sp[11u], sp[12u], sp[13u], sp[14u], sp[15u]);
  }
  if (local_row + 2u < params.rows) {
    store_split(out + 2u, tile, sp[16u], sp[17u], sp[18u], sp[19u], sp[20u], sp[21u], sp[22u], sp[23u]);
  }
  if (local_row + 3u < params.rows) {
    store_split(out + 3u, tile, sp[24u], sp[25u], sp[26u], sp[27u], sp[28u], sp[29u], sp[30u], sp[31u]);
  }
  if (local_row + 4u < params.rows) {
    store_split(out + 4u, tile, sp[32u], sp[33u], sp[34u], sp[35u], sp[36u], sp[37u], sp[38u], sp[39u]);
  }
  if (local_row + 5u < params.rows) {
    store_split(out + 5u, tile, sp[40u], sp[41u], sp[42u], sp[43u], sp[44u], sp[45u], sp[46u], sp[47u]);
  }
  if (local_row + 6u < params.rows) {
    store_split(out + 6u, tile, sp[48u], sp[49u], sp[50u], sp[51u], sp[52u], sp[53u], sp[54u], sp[55u]);
  }
  if (local_row + 7u < params.rows) {
    store_split(out + 7u, tile, sp[56u], sp[57u], sp[58u], sp[59u], sp[60u], sp[61u], sp[62u], sp[63u]);
  }
  if (local_row + 8u < params.rows) {
    store_split(out + 8u, tile, sp[64u], sp[65u], sp[66u], sp[67u], sp[68u], sp[69u], sp[70u], sp[71u]);
  }
  if (local_row + 9u < params.rows) {
    store_split(out + 9u, tile, sp[72u], sp[73u], sp[74u], sp[75u], sp[76u], sp[77u], sp[78u], sp[79u]);
  }
  if (local_row + 10u < params.rows) {
    store_split(out + 10u, tile, sp[80u], sp[81u], sp[82u], sp[83u], sp[84u], sp[85u], sp[86u], sp[87u]);
  }
  if (local_row + 11u < params.rows) {
    store_split(out + 11u, tile, sp[88u], sp[89u], sp[90u], sp[91u], sp[92u], sp[93u], sp[94u], sp[95u]);
  }
  if (local_row + 12u < params.rows) {
    store_split(out + 12u, tile, sp[96u], sp[97u], sp[98u], sp[99u], sp[100u], sp[101u], sp[102u], sp[103u]);
  }
  if (local_row + 13u < params.rows) {
    store_split(out + 13u, tile, sp[104u], sp[105u], sp[106u], sp[107u], sp[108u], sp[109u], sp[110u], sp[111u]);
  }
  if (local_row + 14u < params.rows) {
    store_split(out + 14u, tile, sp[112u], sp[113u], sp[114u], sp[115u], sp[116u], sp[117u], sp[118u], sp[119u]);
  }
  if (local_row + 15u < params.rows) {
    store_split(out + 15u, tile, sp[120u], sp[121u], sp[122u], sp[123u], sp[124u], sp[125u], sp[126u], sp[127u]);
  }
}

// Stores one row's sums of the positions inside the tile (split): p_j's four partial sums
// added as the one-position GEMV adds them.
fn store_split(out: u32, tile: u32, p0: vec4<f32>, p1: vec4<f32>, p2: vec4<f32>, p3: vec4<f32>,
               p4: vec4<f32>, p5: vec4<f32>, p6: vec4<f32>, p7: vec4<f32>) {
  let step = params.y_stride;
  store(out, (p0.x + p0.y) + (p0.z + p0.w));
  if (tile > 1u) { store(out + step, (p1.x + p1.y) + (p1.z + p1.w)); }
  if (tile > 2u) { store(out + 2u * step, (p2.x + p2.y) + (p2.z + p2.w)); }
  if (tile > 3u) { store(out + 3u * step, (p3.x + p3.y) + (p3.z + p3.w)); }
  if (TT == 8u && tile > 4u) { store(out + 4u * step, (p4.x + p4.y) + (p4.z + p4.w)); }
  if (TT == 8u && tile > 5u) { store(out + 5u * step, (p5.x + p5.y) + (p5.z + p5.w)); }
  if (TT == 8u && tile > 6u) { store(out + 6u * step, (p6.x + p6.y) + (p6.z + p6.w)); }
  if (TT == 8u && tile > 7u) { store(out + 7u * step, (p7.x + p7.y) + (p7.z + p7.w)); }
}
