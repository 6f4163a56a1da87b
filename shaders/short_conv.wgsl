// LFM2's gated short convolution (dense spec §3, llama.cpp's shortconv block), per channel
// c < WIDTH and position p = pos0 + t of a chunk, over in_proj's rows [b | c | x] (bcx):
//
//   store:  ring[p mod ring_slots][c] = b_p[c] · x_p[c]                          (bx)
//   conv:   y_t[c] = c_p[c] · Σ_{j < TAPS} w[c][j] · bx_{p - (TAPS - 1) + j}[c]   (bx before 0: none)
//
// two entry points run as two dispatches: the chunk's bx is in the ring before any position
// reads it. The ring keeps every position's bx by p mod ring_slots; ring_slots >= T + TAPS - 1,
// so the chunk's writes never overwrite the TAPS - 1 positions before it, which the chunk
// still reads (decode = prefill: a position's sum reads the same values in the same order).
// The sum runs j = 0 .. TAPS - 1 from 0.0, as ggml_ssm_conv. Constants: WIDTH, TAPS.

struct Params {
  bcx_stride: u32,   // floats between positions in bcx (b at 0, c at WIDTH, x at 2 · WIDTH)
  y_stride: u32,
  ring_slots: u32,
  w_at: u32,         // float offset of the [WIDTH][TAPS] conv weights in `weights`
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> bcx: array<f32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
@group(0) @binding(4) var<storage, read_write> ring: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn store(@builtin(global_invocation_id) gid: vec3<u32>) {
  let c = gid.x;
  let t = gid.y;
  if (c < WIDTH) {
    let row = t * params.bcx_stride;
    let slot = (step.pos0 + t) % params.ring_slots;
    ring[slot * WIDTH + c] = bcx[row + c] * bcx[row + 2u * WIDTH + c];
  }
}

@compute @workgroup_size(64)
fn conv(@builtin(global_invocation_id) gid: vec3<u32>) {
  let c = gid.x;
  let t = gid.y;
  if (c < WIDTH) {
    let p = step.pos0 + t;
    var acc = 0.0;
    for (var j = 0u; j < TAPS; j++) {
      if (p + j >= TAPS - 1u) {  // the position p - (TAPS - 1) + j exists
        let slot = (p + j - (TAPS - 1u)) % params.ring_slots;
        acc += weights[params.w_at + c * TAPS + j] * ring[slot * WIDTH + c];
      }
    }
    y[t * params.y_stride + c] = bcx[t * params.bcx_stride + WIDTH + c] * acc;
  }
}
