// mHC lane norm (spec §4.4, §5.5.1), one workgroup per position:
//
//   nxh[t] = prepare_input(rms_unit(flatten(X_t)))
//
// X_t is the n x d lane block of position t, flattened lane-major (element lane*d + c). The
// result feeds the band matmul of the phi rows (cq_matmul), which gives pre, post and res.
// Constants: GROUP (CQ group), CAP (>= in_pad, the workgroup buffer length), FWHT_SCALE (f32 of
// 1/sqrt(GROUP)), ACT_QUANT (deploy numerics: A8 of rms_unit(X_t) before the transform, §4.9
// point 2).

struct Params {
  width: u32,      // n * d floats of one position
  in_pad: u32,     // pad(n * d): floats written per position
  x_stride: u32,   // floats between positions in lanes
  x_offset: u32,   // float offset of position 0 in lanes
  y_stride: u32,   // floats between positions in nxh
  y_offset: u32,   // float offset of position 0 in nxh
  _pad0: u32,
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> lanes: array<f32>;
@group(0) @binding(2) var<storage, read_write> nxh: array<f32>;

const THREADS: u32 = 256u;
const EPS: f32 = 1e-6;

var<workgroup> fwht_buf: array<f32, CAP>;
var<workgroup> partial: array<f32, THREADS>;

//#include include/fwht.wgsl
//#include include/act_quant.wgsl

// Sum of one value per invocation (tree order); every invocation gets the total.
fn workgroup_sum(lid: u32, value: f32) -> f32 {
  partial[lid] = value;
  workgroupBarrier();
  for (var step = THREADS / 2u; step > 0u; step >>= 1u) {
    if (lid < step) {
      partial[lid] += partial[lid + step];
    }
    workgroupBarrier();
  }
  let total = workgroupUniformLoad(&partial[0]);
  workgroupBarrier();  // partial is reused by the next sum
  return total;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let position = wg.x;
  let base = params.x_offset + position * params.x_stride;
  var squares = 0.0;
  for (var i = lid; i < params.in_pad; i += THREADS) {
    var value = 0.0;
    if (i < params.width) {
      value = lanes[base + i];
    }
    fwht_buf[i] = value;
    squares += value * value;
  }
  // rms_unit (§3): r = 1 / sqrt(mean(x²) + ε), applied before the transform as the reference does.
  let r = 1.0 / sqrt(workgroup_sum(lid, squares) / f32(params.width) + EPS);
  for (var i = lid; i < params.width; i += THREADS) {
    fwht_buf[i] = fwht_buf[i] * r;
  }
  if (ACT_QUANT) {
    act_quant(lid, THREADS, params.width);
  }
  fwht_groups(lid, THREADS, params.in_pad, GROUP, FWHT_SCALE);
  let out = params.y_offset + position * params.y_stride;
  for (var i = lid; i < params.in_pad; i += THREADS) {
    nxh[out + i] = fwht_buf[i];
  }
}
