// Output norm (spec §4.8, §3), one workgroup per position t:
//
//   x̄   = (X[0] + X[1] + ... + X[n-1]) / n         lanes summed in order, then divided
//   x_f = (1 + s) · x̄ · inv,  inv = 1 / sqrt(mean(x̄²) + 1e-6),  s = final_norm (FP16)
//   xfh[t] = prepare_input(x_f): zero-padded to out_pad, normalised FWHT per GROUP (§5.5.1)
//
// The tied head is then cq_matmul of the embedding pack against xfh.
// Constants: GROUP, CAP (>= out_pad), FWHT_SCALE (f32 of 1/sqrt(GROUP)), ACT_QUANT (deploy
// numerics: A8 of x_f before the transform, §4.9 point 7).

struct Params {
  d: u32,
  lanes: u32,        // n
  out_pad: u32,      // pad(d), floats per position in xfh
  norm_at: u32,      // half offset of final_norm in fp16
  lane_stride: u32,  // floats between positions in lanes (n·d)
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> fp16: array<u32>;
@group(0) @binding(2) var<storage, read> lanes: array<f32>;
@group(0) @binding(3) var<storage, read_write> xfh: array<f32>;

const THREADS: u32 = 256u;
const EPS: f32 = 1e-6;

var<workgroup> fwht_buf: array<f32, CAP>;
var<workgroup> partial: array<f32, 256>;

//#include include/fp16.wgsl
//#include include/fwht.wgsl
//#include include/act_quant.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let t = wg.x;
  let base = t * params.lane_stride;
  var squares = 0.0;
  for (var c = lid; c < params.out_pad; c += THREADS) {
    var mean = 0.0;
    if (c < params.d) {
      var total = lanes[base + c];
      for (var j = 1u; j < params.lanes; j++) {
        total += lanes[base + j * params.d + c];
      }
      mean = total / f32(params.lanes);
    }
    fwht_buf[c] = mean;
    squares += mean * mean;
  }
  partial[lid] = squares;
  workgroupBarrier();
  for (var span = THREADS / 2u; span > 0u; span >>= 1u) {
    if (lid < span) {
      partial[lid] += partial[lid + span];
    }
    workgroupBarrier();
  }
  let inv = 1.0 / sqrt(partial[0] / f32(params.d) + EPS);
  for (var c = lid; c < params.d; c += THREADS) {
    fwht_buf[c] = (1.0 + half_at(params.norm_at + c)) * fwht_buf[c] * inv;
  }
  if (ACT_QUANT) {
    act_quant(lid, THREADS, params.d);
  }
  fwht_groups(lid, THREADS, params.out_pad, GROUP, FWHT_SCALE);
  for (var i = lid; i < params.out_pad; i += THREADS) {
    xfh[t * params.out_pad + i] = fwht_buf[i];
  }
}
