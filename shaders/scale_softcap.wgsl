// The head's logits scaled and soft-capped in place (dense spec §3: granite's logit_scale,
// gemma2's final-logit soft-capping), one invocation per element j < WIDTH of row t:
//
//   y  = y · scale                          with SCALE (granite: scale = f32(1 / logit_scale))
//   y  = tanh(y · inv_cap) · cap            with SOFTCAP (gemma2: cap 30, inv_cap = f32(1 / cap))
//
// as llama.cpp's ggml_scale / ggml_tanh / ggml_scale. Constants: WIDTH, SCALE, SOFTCAP.

struct Params {
  y_stride: u32,   // floats between rows
  y_offset: u32,   // float offset of row 0
  scale: f32,
  cap: f32,
  inv_cap: f32,
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let j = gid.x + gid.z * 65535u * 256u;
  let t = gid.y;
  if (j < WIDTH) {
    let at = t * params.y_stride + params.y_offset + j;
    var value = y[at];
    if (SCALE) {
      value = value * params.scale;
    }
    if (SOFTCAP) {
      value = tanh(value * params.inv_cap) * params.cap;
    }
    y[at] = value;
  }
}
