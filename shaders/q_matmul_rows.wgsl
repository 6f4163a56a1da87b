// GGUF dequant-matmul, CPU-adapter shape (dense-gguf spec §8): one output row per invocation.
//
//   y[y_offset + t * y_stride + o] (+)= sum_i W[row0 + o, i] * x[x_offset + t * x_stride + i]
//
// For lavapipe and SwiftShader, which run a workgroup on one CPU thread and vectorise across its
// invocations: no workgroup memory, barriers or subgroups; u32 weight loads, vec4 activation
// loads, f32 accumulators. Each invocation computes TT positions (1: the decode GEMV; 8: the
// prefill GEMM), decoding every quad of weights once for all of them. Loop bounds and branches
// are constants (lavapipe recompiles shaders whose control flow depends on uniforms).
//
// Constants: QTYPE, BLOCK_WORDS, BLOCK_QUADS, SUB_QUADS, ROW_BLOCKS (GPU blocks per row), TT, ACCUMULATE.
// Bindings: 0 params, 1 one part of the pack (word plane, then side plane), 2 x f32, 3 y f32.
// Workgroups: (ceil(rows / 64) folded as x + z * num_workgroups.x, ceil(positions / TT)).

struct Params {
  rows: u32,        // rows computed by this dispatch
  row0: u32,        // first row, counted in the bound part
  side_base: u32,   // word index of the side plane in the part
  positions: u32,
  x_stride: u32,    // floats between positions in x (multiple of 4)
  x_offset: u32,    // float offset of position 0 in x (multiple of 4)
  y_stride: u32,
  y_offset: u32,    // float offset of row 0, position 0 in y
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> weights: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn word(i: u32) -> u32 {
  return weights[i];
}

//#include include/gguf_blocks.wgsl

fn store(index: u32, value: f32) {
  if (ACCUMULATE) {
    y[index] += value;
  } else {
    y[index] = value;
  }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let local_row = (wg.x + wg.z * groups.x) * 64u + lid;
  if (local_row >= params.rows) {
    return;
  }
  let row = params.row0 + local_row;
  let t0 = wg.y * TT;
  let tile = min(TT, params.positions - t0);
  // Positions past the tile read position 0 of the tile (always valid) and are not stored.
  let stride = params.x_stride >> 2u;
  let s1 = select(0u, stride, tile > 1u);
  let s2 = select(0u, 2u * stride, tile > 2u);
  let s3 = select(0u, 3u * stride, tile > 3u);
  let s4 = select(0u, 4u * stride, tile > 4u);
  let s5 = select(0u, 5u * stride, tile > 5u);
  let s6 = select(0u, 6u * stride, tile > 6u);
  let s7 = select(0u, 7u * stride, tile > 7u);
  let x_base = (params.x_offset + t0 * params.x_stride) >> 2u;

  var acc = vec4<f32>(0.0);     // TT = 1: four partial sums of position 0; else positions 0..3
  var acc_hi = vec4<f32>(0.0);  // positions 4..7 when TT = 8
  for (var b = 0u; b < ROW_BLOCKS; b++) {
    let block = row * ROW_BLOCKS + b;
    for (var s = 0u; s < BLOCK_QUADS / SUB_QUADS; s++) {
      let scale = sub_scale(block, s);  // decoded once per sub-block
      let xs = x_base + b * BLOCK_QUADS + s * SUB_QUADS;
      for (var jj = 0u; jj < SUB_QUADS; jj++) {
        let w = scale.x * sub_quad(block, s, jj) + scale.y;
        let xi = xs + jj;
        if (TT == 1u) {
          acc += w * x[xi];
        } else {
          acc += vec4<f32>(dot(w, x[xi]), dot(w, x[xi + s1]), dot(w, x[xi + s2]), dot(w, x[xi + s3]));
          if (TT == 8u) {
            acc_hi += vec4<f32>(dot(w, x[xi + s4]), dot(w, x[xi + s5]), dot(w, x[xi + s6]), dot(w, x[xi + s7]));
          }
        }
      }
    }
  }

  let out = params.y_offset + t0 * params.y_stride + local_row;
  if (TT == 1u) {
    store(out, (acc.x + acc.y) + (acc.z + acc.w));
    return;
  }
  store(out, acc.x);
  if (tile > 1u) { store(out + params.y_stride, acc.y); }
  if (tile > 2u) { store(out + 2u * params.y_stride, acc.z); }
  if (tile > 3u) { store(out + 3u * params.y_stride, acc.w); }
  if (tile > 4u) { store(out + 4u * params.y_stride, acc_hi.x); }
  if (tile > 5u) { store(out + 5u * params.y_stride, acc_hi.y); }
  if (tile > 6u) { store(out + 6u * params.y_stride, acc_hi.z); }
  if (tile > 7u) { store(out + 7u * params.y_stride, acc_hi.w); }
}
