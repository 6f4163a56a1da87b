// MoE routing (dense-gguf spec §3, MoE), one invocation per position t:
//
//   p = softmax(logits[t])  over all N_EXPERT experts (max-subtracted, f32)
//   the K most probable experts e_0 .. e_{K-1}, in order of probability, ties to the lower index
//   w_j = p_{e_j} / max(sum_j p_{e_j}, RENORM_FLOOR)  when RENORMALISE (qwen3moe), else p_{e_j} (olmoe)
//   routes[t][j] = (e_j, bitcast<u32>(w_j))
//
// The routes stay on the GPU: the expert matmuls (q_matmul_routed.wgsl) read the ids from them.
// Pick j is the best expert ranked strictly after pick j-1 in the order (p descending, index
// ascending), so no per-expert "taken" flags are needed. A NaN logit is never picked over a
// number; an id is always < N_EXPERT (no-panic contract). Loop bounds are constants.
//
// Constants: N_EXPERT, K, RENORMALISE, RENORM_FLOOR. Bindings: 0 params, 1 logits f32
// [T][logits_stride], 2 routes u32 [T][K][2]. Workgroups: (ceil(positions / 64)).

struct Params {
  positions: u32,
  logits_stride: u32,  // floats between positions in logits
  logits_offset: u32,
  _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> routes: array<u32>;

// Whether (p, e) ranks strictly after (p0, e0): lower probability, or equal and a higher index.
fn after(p: f32, e: u32, p0: f32, e0: u32) -> bool {
  return p < p0 || (p == p0 && e > e0);
}

// Whether (p, e) ranks strictly before (p1, e1).
fn before(p: f32, e: u32, p1: f32, e1: u32) -> bool {
  return p > p1 || (p == p1 && e < e1);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let t = gid.x;
  if (t >= params.positions) {
    return;
  }
  let base = params.logits_offset + t * params.logits_stride;
  var top = logits[base];
  for (var e = 1u; e < N_EXPERT; e++) {
    top = max(top, logits[base + e]);
  }
  var total = 0.0;
  for (var e = 0u; e < N_EXPERT; e++) {
    total += exp(logits[base + e] - top);
  }
  var ids: array<u32, K>;
  var probs: array<f32, K>;
  var kept = 0.0;
  var last_p = 3.0;       // above any probability: the first pick may be any expert
  var last_e = 0u;
  for (var j = 0u; j < K; j++) {
    var best_p = -1.0;
    var best_e = N_EXPERT - 1u;
    for (var e = 0u; e < N_EXPERT; e++) {
      let p = exp(logits[base + e] - top) / total;
      if (after(p, e, last_p, last_e) && before(p, e, best_p, best_e)) {
        best_p = p;
        best_e = e;
      }
    }
    ids[j] = best_e;
    probs[j] = max(best_p, 0.0);
    kept += probs[j];
    last_p = best_p;
    last_e = best_e;
  }
  for (var j = 0u; j < K; j++) {
    let w = select(probs[j], probs[j] / max(kept, RENORM_FLOOR), RENORMALISE);
    routes[2u * (t * K + j)] = ids[j];
    routes[2u * (t * K + j) + 1u] = bitcast<u32>(w);
  }
}
