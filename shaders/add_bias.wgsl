// A bias added to T rows (dense spec §3: qwen2's optional output.bias on the head's logits),
// one invocation per element j < WIDTH of row t:
//
//   y[t * y_stride + y_offset + j] += bias[bias_at + j]
//
// Constant: WIDTH.

struct Params {
  y_stride: u32,   // floats between rows
  y_offset: u32,   // float offset of row 0
  bias_at: u32,    // float offset of the bias in its buffer
  _pad0: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> bias: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let j = gid.x + gid.z * 65535u * 256u;
  let t = gid.y;
  if (j < WIDTH) {
    let at = t * params.y_stride + params.y_offset + j;
    y[at] = y[at] + bias[params.bias_at + j];
  }
}
