// Logits processing before the sampler (docs/api.md: logit_bias, repetition/presence/frequency
// penalties), in place on the row the sampler reads. The definition is
// needle_wgpu/reference/sampling.py (process_logits, steps 0a and 0b). Two entries of one plan:
//
//   count   one invocation per bias entry: l_id += bias (the host gives each id once); one per
//           window position q (the latest `window` positions up to the row's p = pos0 + T - 1,
//           read from the session's `tokens`, ids by absolute position): counts[id] += 1
//   apply   one invocation per window position: the one whose atomicExchange takes the count
//           (one per distinct id, whichever it is: the result is the same) applies the
//           repetition penalty, then subtracts count · frequency + presence; the exchange
//           leaves `counts` all zero again for the next plan that uses it.
// Ids at or above `rows` (saturated prompt ids) have no logit and are skipped.

struct Params {
  rows: u32,
  logits_offset: u32,   // float offset of the row the sampler reads
  positions: u32,       // T: the row is position pos0 + T - 1
  window: u32,          // positions the penalties look at (0: none, only the bias)
  bias_count: u32,      // (id, f32 bits) pairs in `bias`
  scale_positive: f32,  // f32(1 / repetition_penalty): positive logits are multiplied by it
  scale_negative: f32,  // repetition_penalty: the others are multiplied by it
  presence: f32,
  frequency: f32,
  zero: u32,            // always 0, unknown to the compiler: see `rounded`
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
@group(0) @binding(3) var<storage, read> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> counts: array<atomic<u32>>;  // [rows], all zero between plans
@group(0) @binding(5) var<storage, read> bias: array<u32>;  // pairs (id, bits of the bias)

const NONE: u32 = 0xFFFFFFFFu;

// A product rounded to float32 on its own, as the reference computes it: passed through a runtime
// zero the compiler cannot see through, it is never fused with the following add into an fma
// (a GPU compiler may contract a * b + c; the samplers need no such guard, they subtract first).
fn rounded(product: f32) -> f32 {
  return bitcast<f32>(bitcast<u32>(product) ^ params.zero);
}

// The id at window slot `i` (position p - i), or NONE past the window or the start of the context.
fn window_id(i: u32) -> u32 {
  let last = chunk.pos0 + params.positions - 1u;
  if (i >= params.window || i > last) {
    return NONE;
  }
  let id = tokens[last - i];
  return select(NONE, id, id < params.rows);
}

@compute @workgroup_size(256)
fn count(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i < params.bias_count) {
    let id = bias[2u * i];
    if (id < params.rows) {
      let at = params.logits_offset + id;
      logits[at] = logits[at] + bitcast<f32>(bias[2u * i + 1u]);
    }
  }
  let id = window_id(i);
  if (id != NONE) {
    atomicAdd(&counts[id], 1u);
  }
}

@compute @workgroup_size(256)
fn apply(@builtin(global_invocation_id) gid: vec3<u32>) {
  let id = window_id(gid.x);
  if (id == NONE) {
    return;
  }
  let seen = atomicExchange(&counts[id], 0u);
  if (seen == 0u) {
    return;  // another invocation of this id took the count
  }
  let at = params.logits_offset + id;
  let l = logits[at];
  let scaled = rounded(select(l * params.scale_negative, l * params.scale_positive, l > 0.0));
  let drop = rounded(f32(seen) * params.frequency) + params.presence;
  logits[at] = scaled - drop;
}
