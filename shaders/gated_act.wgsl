// The gated FFN activation (dense spec §3), one invocation per element j < WIDTH of position t:
//
//   out[t][j] = act(g[t][j]) · u[t][j]
//   ACT 0 (SwiGLU: llama, qwen)  act(g) = silu(g) = g / (1 + e^(-g))
//   ACT 1 (Gemma 3)              act(g) = 0.5·g·(1 + tanh(GELU_SCALE·(g + GELU_CUBIC·g³)))
//
// g and u may be two parts of one buffer (a fused gate|up matmul): both are read-only. The tanh
// argument is clamped to ±10, where tanh is 1 in f32 already: some GPUs' tanh returns NaN for
// large arguments. Constants: WIDTH, ACT, GELU_SCALE, GELU_CUBIC.

struct Params {
  gate_stride: u32,   // floats between positions
  gate_offset: u32,   // float offset of g inside a row
  up_stride: u32,
  up_offset: u32,
  out_stride: u32,
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn act(g: f32) -> f32 {
  if (ACT == 1u) {
    let inner = clamp(GELU_SCALE * (g + GELU_CUBIC * (g * g * g)), -10.0, 10.0);
    return 0.5 * g * (1.0 + tanh(inner));
  }
  return g / (1.0 + exp(-g));
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let j = gid.x;
  let t = gid.y;
  if (j < WIDTH) {
    let g = gate[t * params.gate_stride + params.gate_offset + j];
    let u = up[t * params.up_stride + params.up_offset + j];
    out[t * params.out_stride + j] = act(g) * u;
  }
}
