// GGUF dequant-matmul through MoE routes (dense-gguf spec §3, MoE): the rows of the expert a
// route names, read from the routes buffer on the GPU (no host readback).
//
// A 3-D expert tensor [N_EXPERT][rows][cols] (expert axis slowest, §2) is one pack of
// N_EXPERT * rows rows: expert e's rows are the contiguous range [e * rows, (e + 1) * rows).
// routes[t][j] = (expert id, bitcast weight), K per position (moe_router.wgsl).
//
//   COMBINE false (gate, up):  y[y_offset + (t*K + j) * y_stride + o] = W_e(t,j)[o] · x[t]
//   COMBINE true  (down):      y[y_offset + t * y_stride + o] = sum_j w(t,j) · (W_e(t,j)[o] · x[t*K + j])
//
// with x rows at x_offset + r * x_stride. The down sum runs over j in order (as the reference).
// One invocation per output row and position (or route): only the selected experts' rows are
// read, and a prefill computes each token's own experts. Block decoding is gguf_blocks.wgsl's,
// one scale per sub-block; loop bounds are constants. An id >= N_EXPERT is clamped (no-panic).
//
// Constants: QTYPE, BLOCK_WORDS, BLOCK_QUADS, SUB_QUADS, ROW_BLOCKS, N_EXPERT, K, COMBINE.
// Bindings: 0 params, 1 the pack (word plane, then side plane), 2 routes u32, 3 x f32, 4 y f32.
// Workgroups: (ceil(rows / 64), COMBINE ? positions : positions * K).

struct Params {
  rows: u32,        // rows per expert (the output width)
  side_base: u32,   // word index of the side plane in the pack
  positions: u32,
  x_stride: u32,    // floats between x rows (multiple of 4)
  x_offset: u32,    // multiple of 4
  y_stride: u32,
  y_offset: u32,
  _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> weights: array<u32>;
@group(0) @binding(2) var<storage, read> routes: array<u32>;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

fn word(i: u32) -> u32 {
  return weights[i];
}

//#include include/gguf_blocks.wgsl

// Row `row` of the pack times x row `r`.
fn row_dot(row: u32, r: u32) -> f32 {
  let x_base = (params.x_offset + r * params.x_stride) >> 2u;
  var acc = vec4<f32>(0.0);
  for (var b = 0u; b < ROW_BLOCKS; b++) {
    let block = row * ROW_BLOCKS + b;
    for (var s = 0u; s < BLOCK_QUADS / SUB_QUADS; s++) {
      let c = sub_scale(block, s);
      let xs = x_base + b * BLOCK_QUADS + s * SUB_QUADS;
      for (var jj = 0u; jj < SUB_QUADS; jj++) {
        acc += (c.x * sub_quad(block, s, jj) + c.y) * x[xs + jj];
      }
    }
  }
  return (acc.x + acc.y) + (acc.z + acc.w);
}

fn expert_row(route: u32, o: u32) -> u32 {
  return min(routes[2u * route], N_EXPERT - 1u) * params.rows + o;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
  let o = gid.x;
  if (o >= params.rows) {
    return;
  }
  if (COMBINE) {
    let t = wg.y;
    var sum = 0.0;
    for (var j = 0u; j < K; j++) {
      let route = t * K + j;
      sum += bitcast<f32>(routes[2u * route + 1u]) * row_dot(expert_row(route, o), route);
    }
    y[params.y_offset + t * params.y_stride + o] = sum;
  } else {
    let route = wg.y;
    y[params.y_offset + route * params.y_stride + o] = row_dot(expert_row(route, o), route / K);
  }
}
