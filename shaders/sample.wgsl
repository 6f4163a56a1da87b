// Next-token sampling (spec §9), one workgroup of 256 invocations. The algorithm is defined in
// needle_wgpu/reference/sampling.py, which mirrors this kernel step by step (same chunking,
// same summation order, same counter-based RNG), so both pick the same id for the same seed.
//
// Logits are compared through an order-preserving u32 key of their bits (NaN counts as -inf);
// thread `lid` owns the contiguous indices [lid·ITEMS, (lid + 1)·ITEMS).
//   greedy (temperature <= 0, top_k == 1, no finite maximum, or a +inf logit): the largest
//     logit, lowest index on ties (all -inf/NaN -> 0);
//   otherwise: candidates = the K = (top_k or rows) largest logits (ties by lowest index,
//     found by an exact 4-pass radix select); w_i = exp((l_i - max) / temperature);
//     nucleus = candidates with key >= θ, θ the largest key whose mass Σ_{key >= θ} w reaches
//     top_p·Σw (binary search on the key; every tie at θ is kept); then the inverse CDF in
//     index order over the nucleus at u·mass, u = the 24-bit uniform of
//     pcg(seed ^ pcg(position of the drawn token)).
// Writes the id into tokens[p + 1] (when p + 1 < context) and result = [id, flags, p + 1,
// bits of the chosen logit]; flags: 1 = written to tokens, 2 = greedy, 4 = no finite logit.
//
// Constant: ITEMS = ceil(rows / 256).

struct Params {
  rows: u32,
  logits_offset: u32,   // float offset of the logits row of the chunk's last position
  positions: u32,       // T: the row is position pos0 + T - 1
  context: u32,         // tokens holds [context] ids
  temperature: f32,
  top_k: u32,           // 0 = all
  top_p: f32,           // >= 1 = off
  seed: u32,
}

//#include step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> result: array<u32>;

const THREADS: u32 = 256u;
const NONE: u32 = 0xFFFFFFFFu;
const NEG_INF_KEY: u32 = 0x007FFFFFu;  // order_key(-inf); 0 marks the padding past `rows`
const POS_INF_KEY: u32 = 0xFF800000u;
const FLAG_WRITTEN: u32 = 1u;
const FLAG_GREEDY: u32 = 2u;
const FLAG_NO_FINITE: u32 = 4u;

var<workgroup> red_key: array<u32, 256>;
var<workgroup> red_index: array<u32, 256>;
var<workgroup> red_sum: array<f32, 256>;
var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> shared_u32: u32;
var<workgroup> shared_u32b: u32;
var<workgroup> shared_f32: f32;

// Larger logit <=> larger key; NaN maps to the key of -inf.
fn order_key(x: f32) -> u32 {
  let b = bitcast<u32>(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
    return NEG_INF_KEY;
  }
  return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn key_value(k: u32) -> f32 {
  return bitcast<f32>(select(~k, k & 0x7FFFFFFFu, (k & 0x80000000u) != 0u));
}

fn pcg_hash(x: u32) -> u32 {
  let state = x * 747796405u + 2891336453u;
  let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
  return (word >> 22u) ^ word;
}

// Σ over the workgroup: per-thread values summed by a fixed tree; the same value everywhere.
fn block_sum(lid: u32, value: f32) -> f32 {
  red_sum[lid] = value;
  workgroupBarrier();
  for (var span = THREADS / 2u; span > 0u; span >>= 1u) {
    if (lid < span) {
      red_sum[lid] += red_sum[lid + span];
    }
    workgroupBarrier();
  }
  if (lid == 0u) {
    shared_f32 = red_sum[0];
  }
  return workgroupUniformLoad(&shared_f32);
}

// Inclusive prefix sum over threads (Hillis-Steele) of u32 counts in red_key; `reverse` sums
// from the top thread down (a suffix sum).
fn block_scan(lid: u32, value: u32, reverse: bool) -> u32 {
  red_key[lid] = value;
  workgroupBarrier();
  for (var offset = 1u; offset < THREADS; offset <<= 1u) {
    var v = red_key[lid];
    if (reverse && lid + offset < THREADS) {
      v += red_key[lid + offset];
    }
    if (!reverse && lid >= offset) {
      v += red_key[lid - offset];
    }
    workgroupBarrier();
    red_key[lid] = v;
    workgroupBarrier();
  }
  return red_key[lid];
}

// Σ of the weights whose key is >= theta.
fn mass_from(lid: u32, keys: ptr<function, array<u32, ITEMS>>, w: ptr<function, array<f32, ITEMS>>,
             theta: u32) -> f32 {
  var own = 0.0;
  for (var e = 0u; e < ITEMS; e++) {
    own += select(0.0, (*w)[e], (*keys)[e] >= theta);
  }
  return block_sum(lid, own);
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
    if (i < rows) {
      k = order_key(logits[params.logits_offset + i]);
    }
    keys[e] = k;
    if (k > best_key) {
      best_key = k;
      best_index = i;
    }
  }

  // Greedy: the largest key, lowest index on ties (indices ascend within and across threads).
  red_key[lid] = best_key;
  red_index[lid] = best_index;
  workgroupBarrier();
  for (var span = THREADS / 2u; span > 0u; span >>= 1u) {
    if (lid < span) {
      let other_key = red_key[lid + span];
      let other_index = red_index[lid + span];
      if (other_key > red_key[lid] || (other_key == red_key[lid] && other_index < red_index[lid])) {
        red_key[lid] = other_key;
        red_index[lid] = other_index;
      }
    }
    workgroupBarrier();
  }
  if (lid == 0u) {
    shared_u32 = red_key[0];
    shared_u32b = red_index[0];
  }
  let max_key = workgroupUniformLoad(&shared_u32);
  var chosen = workgroupUniformLoad(&shared_u32b);
  var flags = 0u;
  if (max_key == NEG_INF_KEY) {
    flags |= FLAG_NO_FINITE;
  }
  let greedy = params.temperature <= 0.0 || params.top_k == 1u || params.top_p <= 0.0 ||
               max_key == NEG_INF_KEY || max_key == POS_INF_KEY;
  if (greedy) {
    flags |= FLAG_GREEDY;
  } else {
    let top = key_value(max_key);

    // Top-k threshold: the K-th largest key by radix select, 8 bits per pass from the top.
    var theta_k = 1u;      // K >= rows: every real logit (padding has key 0)
    var ties_needed = 0u;
    var k_count = rows;
    if (params.top_k != 0u) {
      k_count = min(params.top_k, rows);
    }
    if (k_count < rows) {
      var prefix = 0u;
      var remaining = k_count;
      for (var sweep = 0u; sweep < 4u; sweep++) {
        let shift = 24u - 8u * sweep;
        let high = select(0xFFFFFFFFu << ((shift + 8u) & 31u), 0u, sweep == 0u);
        atomicStore(&hist[lid], 0u);
        workgroupBarrier();
        for (var e = 0u; e < ITEMS; e++) {
          if ((keys[e] & high) == prefix) {
            atomicAdd(&hist[(keys[e] >> shift) & 255u], 1u);
          }
        }
        workgroupBarrier();
        let count = atomicLoad(&hist[lid]);
        let at_or_above = block_scan(lid, count, true);
        let above = at_or_above - count;
        if (above < remaining && remaining <= at_or_above) {
          shared_u32 = lid;
          shared_u32b = remaining - above;
        }
        let digit = workgroupUniformLoad(&shared_u32);
        remaining = workgroupUniformLoad(&shared_u32b);
        prefix |= digit << shift;
      }
      theta_k = prefix;
      ties_needed = remaining;
    }

    // Ties at theta_k are taken in index order: rank them with a prefix count over threads.
    var ties = 0u;
    for (var e = 0u; e < ITEMS; e++) {
      ties += select(0u, 1u, keys[e] == theta_k);
    }
    var tie_rank = block_scan(lid, ties, false) - ties;

    var w: array<f32, ITEMS>;
    var own = 0.0;
    for (var e = 0u; e < ITEMS; e++) {
      let k = keys[e];
      var candidate = k > theta_k;
      if (k == theta_k) {
        candidate = tie_rank < ties_needed;
        tie_rank += 1u;
      }
      var weight = 0.0;
      if (candidate && k != NEG_INF_KEY) {
        weight = exp((key_value(k) - top) / params.temperature);
      }
      w[e] = weight;
      own += weight;
    }
    let total = block_sum(lid, own);

    // Nucleus: the largest theta with mass(theta) >= top_p·total (mass(0) = total).
    var theta_p = 0u;
    var nucleus = total;
    if (params.top_p < 1.0) {
      let goal_mass = params.top_p * total;
      var lo = 0u;
      var hi = max_key;
      for (var it = 0u; it < 33u && lo < hi; it++) {
        let gap = hi - lo;
        let mid = lo + (gap >> 1u) + (gap & 1u);
        if (mass_from(lid, &keys, &w, mid) >= goal_mass) {
          lo = mid;
        } else {
          hi = mid - 1u;
        }
      }
      theta_p = lo;
      nucleus = mass_from(lid, &keys, &w, theta_p);
    }

    // Inverse CDF in index order: per-thread sums, a sequential exclusive scan, then a walk.
    let position = chunk.pos0 + params.positions;
    let draw = pcg_hash(params.seed ^ pcg_hash(position));
    let goal = f32(draw >> 8u) * (1.0 / 16777216.0) * nucleus;
    own = 0.0;
    for (var e = 0u; e < ITEMS; e++) {
      own += select(0.0, w[e], keys[e] >= theta_p);
    }
    red_sum[lid] = own;
    workgroupBarrier();
    if (lid == 0u) {
      var running = 0.0;
      for (var i = 0u; i < THREADS; i++) {
        let v = red_sum[i];
        red_sum[i] = running;
        running += v;
      }
    }
    workgroupBarrier();
    var cum = red_sum[lid];
    var found = NONE;
    var last = NONE;
    for (var e = 0u; e < ITEMS; e++) {
      if (keys[e] >= theta_p && w[e] > 0.0) {
        cum += w[e];
        last = base + e;
        if (cum > goal && found == NONE) {
          found = base + e;
        }
      }
    }
    // The first crossing over all threads; past the end (rounding), the last nucleus index.
    red_index[lid] = found;
    red_key[lid] = select(last, 0u, last == NONE);
    workgroupBarrier();
    for (var span = THREADS / 2u; span > 0u; span >>= 1u) {
      if (lid < span) {
        red_index[lid] = min(red_index[lid], red_index[lid + span]);
        red_key[lid] = max(red_key[lid], red_key[lid + span]);
      }
      workgroupBarrier();
    }
    chosen = select(red_index[0], red_key[0], red_index[0] == NONE);
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
