// RMSNorm of rows (dense spec §3), one workgroup per position t:
//
//   y[t][i] = x_i · (1 / sqrt(mean(x²) + eps)) · w_i    over the WIDTH floats of row t
//
// (ggml's order: scale the row, then multiply by the weights.) Constants: WIDTH. Sizes are
// constants: lavapipe recompiles a shader at every dispatch whose control flow depends on
// uniform values alone.

struct Params {
  x_stride: u32,   // floats between positions in x
  x_offset: u32,   // float offset of row 0 in x
  y_stride: u32,
  y_offset: u32,
  w_at: u32,       // float offset of the weights in `weights`
  eps: f32,
  _pad0: u32,
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weights: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const THREADS: u32 = 256u;

//#include include/workgroup_sum.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let row = params.x_offset + wg.x * params.x_stride;
  let out = params.y_offset + wg.x * params.y_stride;
  var squares = 0.0;
  for (var i = lid; i < WIDTH; i += THREADS) {
    let value = x[row + i];
    squares += value * value;
  }
  let total = workgroup_sum(lid, vec4<f32>(squares, 0.0, 0.0, 0.0)).x;
  let inv = 1.0 / sqrt(total / f32(WIDTH) + params.eps);
  for (var i = lid; i < WIDTH; i += THREADS) {
    y[out + i] = (x[row + i] * inv) * weights[params.w_at + i];
  }
}
