// prepare_input (spec §5.5.1): copy x into xh (in_pad long, zero padding) and apply the
// normalised FWHT to every G-chunk, one workgroup per position. Constants: GROUP, CAP (the
// largest in_pad this variant handles), FWHT_SCALE (f32 of 1/sqrt(GROUP)), ACT_QUANT (deploy
// numerics: A8 of x before the transform, one scale per position; Needle 3's o ⊙ σ(g) before
// out_proj, §4.9 point 6).

struct Params {
  width: u32,      // in features of x
  in_pad: u32,     // padded width (multiple of GROUP) = floats per position in xh
  x_stride: u32,
  x_offset: u32,
  y_stride: u32,
  y_offset: u32,
  _pad0: u32,
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> xh: array<f32>;

var<workgroup> fwht_buf: array<f32, CAP>;

//#include include/fwht.wgsl
//#include include/act_quant.wgsl

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let position = wg.x;
  for (var i = lid; i < params.in_pad; i += 256u) {
    var value = 0.0;
    if (i < params.width) {
      value = x[params.x_offset + position * params.x_stride + i];
    }
    fwht_buf[i] = value;
  }
  if (ACT_QUANT) {
    act_quant(lid, 256u, params.width);
  }
  fwht_groups(lid, 256u, params.in_pad, GROUP, FWHT_SCALE);
  for (var i = lid; i < params.in_pad; i += 256u) {
    xh[params.y_offset + position * params.y_stride + i] = fwht_buf[i];
  }
}
