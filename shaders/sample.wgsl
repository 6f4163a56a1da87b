// Next-token sampling (spec §9) in one workgroup of 256 invocations: the path for vocabularies
// up to 16,384 (sample_staged.wgsl takes the larger ones). The algorithm is defined in
// needle_wgpu/reference/sampling.py; weights are integers, so the sums need no fixed order.
//
// Logits are compared through an order-preserving u32 key of their bits (NaN counts as -inf);
// invocation `lid` holds the keys and weights of indices [lid·ITEMS, (lid + 1)·ITEMS).
//   greedy (the settings say so, no finite maximum, or a +inf logit): the largest logit,
//     lowest index on ties (all -inf/NaN -> 0);
//   otherwise: candidates = the K = (top_k or rows) largest logits (ties by lowest index, an
//     exact 4-pass radix select on the counts); w_i = floor(exp((l_i - max) · (1/T)) · 2^24),
//     0 below min_p's threshold;
//     nucleus = candidates with key >= θ, θ the largest key whose mass Σ_{key >= θ} w reaches
//     the target (a 4-pass radix select on the weights; every tie at θ is kept); then the
//     first nucleus index, in index order, whose running mass exceeds floor(u · mass / 2^24).
// Writes the id into tokens[p + 1] (when p + 1 < context) and result = [id, flags, p + 1,
// bits of the chosen logit]; flags: 1 = written to tokens, 2 = greedy, 4 = no finite logit.
//
// Constants: ITEMS = ceil(rows / 256) (at most 64: per-invocation weight sums stay below 2^32);
// MASKED (bool): ids outside the bitmask `mask` read as -inf and are never the argmax.

struct Params {
  rows: u32,
  logits_offset: u32,   // float offset of the logits row of the chunk's last position
  positions: u32,       // T: the row is position pos0 + T - 1
  context: u32,         // tokens holds [context] ids
  weight_scale: f32,    // 2^24 / temperature (needle_wgpu.sampling.sampler_constants)
  top_k: u32,           // 0 = all
  top_p: u32,           // in 2^-24; 2^24 = off
  seed: u32,
  greedy: u32,          // 1: the settings ask for the argmax
  min_weight: u32,      // min_p: candidates weighing less weigh 0 (0 = off; sampling.min_weight)
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> result: array<u32>;
@group(0) @binding(5) var<storage, read> mask: array<u32>;  // MASKED: allowed ids (else one word, unread)

const THREADS: u32 = 256u;

//#include include/sample_common.wgsl

var<workgroup> picked: u32;

// The radix select of the K-th largest key: (θ, how many of the ties at θ are in the top K).
fn top_k_threshold(lid: u32, keys: ptr<function, array<u32, ITEMS>>, k_count: u32) -> vec2<u32> {
  var prefix = 0u;
  var remaining = k_count;
  for (var sweep = 0u; sweep < 4u; sweep++) {
    let shift = 24u - 8u * sweep;
    let high = select(0xFFFFFFFFu << ((shift + 8u) & 31u), 0u, sweep == 0u);
    hist_clear(lid);
    workgroupBarrier();
    for (var e = 0u; e < ITEMS; e++) {
      let k = (*keys)[e];
      if (k != 0u && (k & high) == prefix) {
        hist_add((k >> shift) & 255u, 1u);
      }
    }
    workgroupBarrier();
    let pick = select_digit(lid, hist_bin(lid), vec2<u32>(remaining, 0u));
    prefix |= pick.x << shift;
    remaining = pick.y;
  }
  return vec2<u32>(prefix, remaining);
}

// The radix select of the nucleus threshold: the largest θ with Σ_{key >= θ} w >= goal_mass.
fn top_p_threshold(lid: u32, keys: ptr<function, array<u32, ITEMS>>, w: ptr<function, array<u32, ITEMS>>,
                   goal_mass: vec2<u32>) -> u32 {
  var prefix = 0u;
  var remaining = goal_mass;
  for (var sweep = 0u; sweep < 4u; sweep++) {
    let shift = 24u - 8u * sweep;
    let high = select(0xFFFFFFFFu << ((shift + 8u) & 31u), 0u, sweep == 0u);
    hist_clear(lid);
    workgroupBarrier();
    for (var e = 0u; e < ITEMS; e++) {
      let k = (*keys)[e];
      if ((*w)[e] > 0u && (k & high) == prefix) {
        hist_add((k >> shift) & 255u, (*w)[e]);
      }
    }
    workgroupBarrier();
    let pick = select_digit(lid, hist_bin(lid), remaining);
    prefix |= pick.x << shift;
    remaining = pick.yz;
  }
  return prefix;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32) {
  let rows = params.rows;
  let base = lid * ITEMS;
  var keys: array<u32, ITEMS>;
  var best_key = 0u;
  var best_index = NONE;
  for (var e = 0u; e < ITEMS; e++) {
    let i = base + e;
    var k = 0u;
    var may_win = false;
    if (i < rows) {
      k = order_key(logits[params.logits_offset + i]);
      may_win = allowed(i);
      if (!may_win) {
        k = NEG_INF_KEY;
      }
    }
    keys[e] = k;
    if (may_win && k > best_key) {
      best_key = k;
      best_index = i;
    }
  }

  // Greedy: the largest key, lowest index on ties.
  let best = block_argmax(lid, best_key, best_index);
  let max_key = best.x;
  var chosen = best.y;
  var flags = 0u;
  if (max_key == NEG_INF_KEY) {
    flags |= FLAG_NO_FINITE;
  }
  if (params.greedy != 0u || max_key == NEG_INF_KEY || max_key == POS_INF_KEY) {
    flags |= FLAG_GREEDY;
  } else {
    let top = weight_value(max_key);

    // Top-k threshold; K >= rows keeps every real logit (padding has key 0).
    var theta_k = 1u;
    var ties_needed = 0u;
    var k_count = rows;
    if (params.top_k != 0u) {
      k_count = min(params.top_k, rows);
    }
    if (k_count < rows) {
      let threshold = top_k_threshold(lid, &keys, k_count);
      theta_k = threshold.x;
      ties_needed = threshold.y;
    }

    // Ties at theta_k are taken in index order: rank them with a prefix count over threads.
    var ties = 0u;
    for (var e = 0u; e < ITEMS; e++) {
      ties += select(0u, 1u, keys[e] == theta_k);
    }
    var tie_rank = block_scan64(lid, vec2<u32>(ties, 0u)).x;

    var w: array<u32, ITEMS>;
    var own = 0u;
    for (var e = 0u; e < ITEMS; e++) {
      let k = keys[e];
      var candidate = k > theta_k;
      if (k == theta_k) {
        candidate = tie_rank < ties_needed;
        tie_rank += 1u;
      }
      var weight = 0u;
      if (candidate) {
        weight = weight_of(k, top, params.weight_scale);
        weight = select(weight, 0u, weight < params.min_weight);
      }
      w[e] = weight;
      own += weight;
    }

    var theta_p = 0u;
    if (params.top_p < WEIGHT_ONE) {
      let total = block_sum64(lid, vec2<u32>(own, 0u));
      theta_p = top_p_threshold(lid, &keys, &w, nucleus_target(total, params.top_p));
    }

    // The draw: this invocation's share of the nucleus, its place in index order, then the walk.
    own = 0u;
    for (var e = 0u; e < ITEMS; e++) {
      own += select(0u, w[e], keys[e] >= theta_p);
    }
    let share = vec2<u32>(own, 0u);
    let before = block_scan64(lid, share);
    let mass = block_sum64(lid, share);
    let position = chunk.pos0 + params.positions;
    let goal = scale24(mass, draw24(params.seed, position)).xy;
    if (!less64(goal, before) && less64(goal, add64(before, share))) {
      let rest = sub64(goal, before).x;
      var running = 0u;
      for (var e = 0u; e < ITEMS; e++) {
        if (keys[e] >= theta_p) {
          running += w[e];
          if (running > rest) {
            picked = base + e;
            break;
          }
        }
      }
    }
    chosen = workgroupUniformLoad(&picked);
  }

  if (lid == 0u) {
    let next = chunk.pos0 + params.positions;
    if (next < params.context) {
      tokens[next] = chosen;
      flags |= FLAG_WRITTEN;
    }
    result[0] = chosen;
    result[1] = flags;
    result[2] = next;
    result[3] = bitcast<u32>(logits[params.logits_offset + chosen]);
  }
}
