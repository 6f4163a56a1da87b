// Residual add fused with the next RMSNorm (dense spec §3), one workgroup per position t:
//
//   r'  = r, or with RESIDUAL_NORM r_i · (1 / sqrt(mean(r²) + eps)) · wr_i (Gemma 3's
//         post-attention / post-FFN norm of the sublayer output); with RESIDUAL_SCALE times
//         r_scale (granite's residual_scale)
//   x  <- x + r'                                        the residual stream, updated in place
//   y   = x_i · (1 / sqrt(mean(x²) + eps)) · w_i        the next sublayer's normed input
//
// over the WIDTH floats of row t (without NORMED only the add: y is not written). Each
// invocation reads back only the x values it wrote. Constants: WIDTH, RESIDUAL_NORM,
// RESIDUAL_SCALE, NORMED (false, false, true: the plain add and norm, unchanged bits).

struct Params {
  x_stride: u32,   // floats between positions in x
  r_stride: u32,
  y_stride: u32,
  w_at: u32,       // float offsets in `weights`: the norm of the sum, and of the residual
  r_w_at: u32,
  eps: f32,
  r_scale: f32,    // granite's residual_scale (RESIDUAL_SCALE)
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> residual: array<f32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const THREADS: u32 = 256u;

//#include include/workgroup_sum.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let row = wg.x * params.x_stride;
  let r_row = wg.x * params.r_stride;
  var r_inv = 1.0;
  if (RESIDUAL_NORM) {
    var r_squares = 0.0;
    for (var i = lid; i < WIDTH; i += THREADS) {
      let value = residual[r_row + i];
      r_squares += value * value;
    }
    let r_total = workgroup_sum(lid, vec4<f32>(r_squares, 0.0, 0.0, 0.0)).x;
    r_inv = 1.0 / sqrt(r_total / f32(WIDTH) + params.eps);
  }
  var squares = 0.0;
  for (var i = lid; i < WIDTH; i += THREADS) {
    var r = residual[r_row + i];
    if (RESIDUAL_NORM) {
      r = (r * r_inv) * weights[params.r_w_at + i];
    }
    if (RESIDUAL_SCALE) {
      r = r * params.r_scale;
    }
    let sum = x[row + i] + r;
    x[row + i] = sum;
    squares += sum * sum;
  }
  if (!NORMED) {
    return;  // uniform: the whole workgroup leaves before the barriers of workgroup_sum
  }
  let total = workgroup_sum(lid, vec4<f32>(squares, 0.0, 0.0, 0.0)).x;
  let inv = 1.0 / sqrt(total / f32(WIDTH) + params.eps);
  for (var i = lid; i < WIDTH; i += THREADS) {
    y[wg.x * params.y_stride + i] = (x[row + i] * inv) * weights[params.w_at + i];
  }
}
