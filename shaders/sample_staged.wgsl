// Next-token sampling (spec §9) for any vocabulary (the path above 16,384 rows; sample.wgsl is
// the one-workgroup path below it). Same definition (needle_wgpu/reference/sampling.py), split
// into passes of one plan, so still one compute pass and one submit. Workgroup g owns the slice
// [g·SLICE, (g+1)·SLICE) of the logits, invocation `lid` its items [lid·ITEMS, (lid + 1)·ITEMS).
// Each pass starts by finishing what the previous pass summed (a few hundred words, the same in
// every workgroup; workgroup 0 keeps the outcome in `state` for the passes after), then sums its
// own slice into a workgroup histogram and adds that to `state` with atomics. Weights are
// integers, so atomic sums in any order give the same bits.
//
//   reduce         max and argmax (lowest index on ties) per slice; workgroup 0 clears the
//                  histograms
//   count_k ×4     top-k: counts per 8-bit digit of the keys that match the digits so far
//   count_ties     θ_k and how many ties at θ_k are in; ties per slice
//   weigh          w_i = floor(exp((l_i - max) · (1/T)) · 2^24) on candidates into `weights` (ties
//                  at θ_k by index: a slice adds the ties of the slices before it; 0 below
//                  min_p's threshold); the kept
//                  mass per slice; top-p: weight sums per top digit
//   sum_p ×3       top-p: weight sums per digit of the keys that match the digits so far
//   keep           θ_p; the kept mass per slice
//   draw (1 wg)    the slice where floor(u · mass / 2^24) falls, then the index inside it
// The plan holds only the passes its settings need (kernels/sample.py); each pass also checks
// the settings itself, so a plan with all of them gives the same ids.
//
// Constants: ITEMS (logits per invocation, at most 128: per-invocation sums stay below 2^32);
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
  groups: u32,          // G = ceil(rows / SLICE)
  digit: u32,           // count_k 0..3, sum_p 1..3
  min_weight: u32,      // min_p: candidates weighing less weigh 0 (0 = off; sampling.min_weight)
}

//#include include/step.wgsl

// The bindings an entry uses form a prefix: reduce, count_k and count_ties 0..2; weigh, sum_p
// and keep 0..3; draw all seven (kernels/sample.py binds exactly those).
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> weights: array<u32>;
@group(0) @binding(4) var<uniform> chunk: Step;
@group(0) @binding(5) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(6) var<storage, read_write> result: array<u32>;
@group(0) @binding(7) var<storage, read> mask: array<u32>;  // MASKED: allowed ids (every entry reads it)

const THREADS: u32 = 256u;
const SLICE: u32 = THREADS * ITEMS;

// `state` words (kernels/sample.py: STATE_SLICES_AT): histograms of 256 u64 bins (cleared by
// reduce), the outcome of each radix step, then 8 words per slice.
const HIST_K: u32 = 0u;      // 4 × 512: counts, digit j
const HIST_P: u32 = 2048u;   // 4 × 512: weight sums, digit j
const HIST_WORDS: u32 = 4096u;
const K_STATE: u32 = 4096u;  // 4 × 2: (prefix, remaining) after digit j
const P_STATE: u32 = 4104u;  // 4 × 4: (prefix, remaining low, remaining high) after digit j
const GREEDY: u32 = 4120u;   // 1 when the logits make it greedy (no finite max, or +inf)
const SLICES: u32 = 4128u;   // per slice: max key, argmax, ties at θ_k, kept mass (2 words)

//#include include/sample_common.wgsl

var<workgroup> shared_flag: u32;
var<workgroup> picked: u32;
var<workgroup> picked_slice: vec3<u32>;

fn slice_word(g: u32, field: u32) -> u32 {
  return SLICES + 8u * g + field;
}

fn load(word: u32) -> u32 {
  return atomicLoad(&state[word]);
}

fn global_bin(at: u32, lid: u32) -> vec2<u32> {
  return vec2<u32>(load(at + 2u * lid), load(at + 2u * lid + 1u));
}

// Adds the workgroup histogram to the 64-bit bins at `at`.
fn flush_hist(lid: u32, at: u32) {
  let bin = hist_bin(lid);
  if (bin.x != 0u) {
    let old = atomicAdd(&state[at + 2u * lid], bin.x);
    let high = bin.y + select(0u, 1u, old + bin.x < old);
    if (high != 0u) {
      atomicAdd(&state[at + 2u * lid + 1u], high);
    }
  } else if (bin.y != 0u) {
    atomicAdd(&state[at + 2u * lid + 1u], bin.y);
  }
}

fn key_at(i: u32) -> u32 {
  if (!allowed(i)) {
    return NEG_INF_KEY;
  }
  return order_key(logits[params.logits_offset + i]);
}

// The max key and argmax of the whole row, from the slices' (reduce).
fn row_argmax(lid: u32) -> vec2<u32> {
  var best = vec2<u32>(0u, NONE);
  for (var g = lid; g < params.groups; g += THREADS) {
    let key = load(slice_word(g, 0u));
    if (key > best.x) {
      best = vec2<u32>(key, load(slice_word(g, 1u)));
    }
  }
  return block_argmax(lid, best.x, best.y);
}

// The K of top-k (rows when top-k is off).
fn k_count() -> u32 {
  return select(params.rows, min(params.top_k, params.rows), params.top_k != 0u);
}

fn uses_top_k() -> bool {
  return k_count() < params.rows;
}

fn uses_top_p() -> bool {
  return params.top_p < WEIGHT_ONE;
}

fn is_first(g: u32, lid: u32) -> bool {
  return g == 0u && lid == 0u;
}

// The mask of the key bits above digit j (digit 0 = the top 8 bits).
fn high_mask(j: u32) -> u32 {
  return select(0xFFFFFFFFu << ((32u - 8u * j) & 31u), 0u, j == 0u);
}

// The greedy flag weigh left in `state`, as a uniform value.
fn logits_are_greedy(lid: u32) -> bool {
  if (lid == 0u) {
    shared_flag = load(GREEDY);
  }
  return workgroupUniformLoad(&shared_flag) != 0u;
}

@compute @workgroup_size(256)
fn reduce(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
  let g = wid.x;
  let base = g * SLICE + lid * ITEMS;
  var best_key = 0u;
  var best_index = NONE;
  for (var e = 0u; e < ITEMS; e++) {
    let i = base + e;
    if (i < params.rows) {
      let k = key_at(i);
      if (allowed(i) && k > best_key) {
        best_key = k;
        best_index = i;
      }
    }
  }
  let best = block_argmax(lid, best_key, best_index);
  if (lid == 0u) {
    atomicStore(&state[slice_word(g, 0u)], best.x);
    atomicStore(&state[slice_word(g, 1u)], best.y);
  }
  if (g == 0u) {
    for (var w = lid; w < HIST_WORDS; w += THREADS) {
      atomicStore(&state[w], 0u);
    }
  }
}

// Top-k digit j: first finish digit j - 1 (from its histogram), then count digit j.
@compute @workgroup_size(256)
fn count_k(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
  let g = wid.x;
  let j = params.digit;
  if (params.greedy != 0u || !uses_top_k()) {
    return;
  }
  var prefix = 0u;
  var remaining = vec2<u32>(k_count(), 0u);
  if (j > 0u) {
    if (j > 1u) {
      prefix = load(K_STATE + 2u * (j - 2u));
      remaining = vec2<u32>(load(K_STATE + 2u * (j - 2u) + 1u), 0u);
    }
    let pick = select_digit(lid, global_bin(HIST_K + 512u * (j - 1u), lid), remaining);
    prefix |= pick.x << (32u - 8u * j);
    remaining = pick.yz;
    if (is_first(g, lid)) {
      atomicStore(&state[K_STATE + 2u * (j - 1u)], prefix);
      atomicStore(&state[K_STATE + 2u * (j - 1u) + 1u], remaining.x);
    }
  }
  let shift = 24u - 8u * j;
  let high = high_mask(j);
  hist_clear(lid);
  workgroupBarrier();
  let base = g * SLICE + lid * ITEMS;
  for (var e = 0u; e < ITEMS; e++) {
    let i = base + e;
    if (i < params.rows) {
      let k = key_at(i);
      if ((k & high) == prefix) {
        hist_add((k >> shift) & 255u, 1u);
      }
    }
  }
  workgroupBarrier();
  flush_hist(lid, HIST_K + 512u * j);
}

// θ_k and the ties it keeps (from digit 3), then the ties at θ_k in this slice.
@compute @workgroup_size(256)
fn count_ties(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
  let g = wid.x;
  if (params.greedy != 0u || !uses_top_k()) {
    return;
  }
  let prefix = load(K_STATE + 4u);
  let pick = select_digit(lid, global_bin(HIST_K + 1536u, lid), vec2<u32>(load(K_STATE + 5u), 0u));
  let theta_k = prefix | pick.x;
  if (is_first(g, lid)) {
    atomicStore(&state[K_STATE + 6u], theta_k);
    atomicStore(&state[K_STATE + 7u], pick.y);
  }
  let base = g * SLICE + lid * ITEMS;
  var ties = 0u;
  for (var e = 0u; e < ITEMS; e++) {
    let i = base + e;
    if (i < params.rows && key_at(i) == theta_k) {
      ties += 1u;
    }
  }
  let total = block_sum64(lid, vec2<u32>(ties, 0u));
  if (lid == 0u) {
    atomicStore(&state[slice_word(g, 2u)], total.x);
  }
}

@compute @workgroup_size(256)
fn weigh(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
  let g = wid.x;
  if (params.greedy != 0u) {
    return;
  }
  let max_key = row_argmax(lid).x;
  let greedy = max_key == NEG_INF_KEY || max_key == POS_INF_KEY;
  if (is_first(g, lid)) {
    atomicStore(&state[GREEDY], select(0u, 1u, greedy));
  }
  if (greedy) {
    return;
  }
  let top = weight_value(max_key);

  // Candidates: key > θ_k, or key == θ_k among the first `ties_needed` ties in index order.
  var theta_k = 1u;  // top-k off: every real logit (keys of real logits are >= NEG_INF_KEY)
  var ties_needed = 0u;
  var tie_rank = 0u;
  let base = g * SLICE + lid * ITEMS;
  if (uses_top_k()) {
    theta_k = load(K_STATE + 6u);
    ties_needed = load(K_STATE + 7u);
    var earlier = 0u;
    for (var other = lid; other < g; other += THREADS) {
      earlier += load(slice_word(other, 2u));
    }
    var ties = 0u;
    for (var e = 0u; e < ITEMS; e++) {
      let i = base + e;
      if (i < params.rows && key_at(i) == theta_k) {
        ties += 1u;
      }
    }
    tie_rank = block_sum64(lid, vec2<u32>(earlier, 0u)).x + block_scan64(lid, vec2<u32>(ties, 0u)).x;
  }

  var own = 0u;
  let top_p = uses_top_p();
  if (top_p) {
    hist_clear(lid);
  }
  workgroupBarrier();
  for (var e = 0u; e < ITEMS; e++) {
    let i = base + e;
    if (i < params.rows) {
      let k = key_at(i);
      var candidate = k > theta_k;
      if (k == theta_k) {
        candidate = tie_rank < ties_needed;
        tie_rank += 1u;
      }
      var w = 0u;
      if (candidate) {
        w = weight_of(k, top, params.weight_scale);
        w = select(w, 0u, w < params.min_weight);
      }
      weights[i] = w;
      own += w;
      if (top_p && w > 0u) {
        hist_add(k >> 24u, w);
      }
    }
  }
  let kept = block_sum64(lid, vec2<u32>(own, 0u));
  if (lid == 0u) {
    atomicStore(&state[slice_word(g, 3u)], kept.x);
    atomicStore(&state[slice_word(g, 4u)], kept.y);
  }
  if (top_p) {
    flush_hist(lid, HIST_P);
  }
}

// Top-p digit j (1..3): first finish digit j - 1, then sum the weights of digit j.
@compute @workgroup_size(256)
fn sum_p(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
  let g = wid.x;
  let j = params.digit;
  if (params.greedy != 0u || !uses_top_p() || logits_are_greedy(lid)) {
    return;
  }
  var prefix = 0u;
  var remaining: vec2<u32>;
  if (j == 1u) {
    remaining = nucleus_target(block_sum64(lid, global_bin(HIST_P, lid)), params.top_p);
  } else {
    let at = P_STATE + 4u * (j - 2u);
    prefix = load(at);
    remaining = vec2<u32>(load(at + 1u), load(at + 2u));
  }
  let pick = select_digit(lid, global_bin(HIST_P + 512u * (j - 1u), lid), remaining);
  prefix |= pick.x << (32u - 8u * j);
  remaining = pick.yz;
  if (is_first(g, lid)) {
    let at = P_STATE + 4u * (j - 1u);
    atomicStore(&state[at], prefix);
    atomicStore(&state[at + 1u], remaining.x);
    atomicStore(&state[at + 2u], remaining.y);
  }
  let shift = 24u - 8u * j;
  let high = high_mask(j);
  hist_clear(lid);
  workgroupBarrier();
  let base = g * SLICE + lid * ITEMS;
  for (var e = 0u; e < ITEMS; e++) {
    let i = base + e;
    if (i < params.rows) {
      let w = weights[i];
      let k = key_at(i);
      if (w > 0u && (k & high) == prefix) {
        hist_add((k >> shift) & 255u, w);
      }
    }
  }
  workgroupBarrier();
  flush_hist(lid, HIST_P + 512u * j);
}

// θ_p (from digit 3), then the kept mass of this slice.
@compute @workgroup_size(256)
fn keep(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
  let g = wid.x;
  if (params.greedy != 0u || !uses_top_p() || logits_are_greedy(lid)) {
    return;
  }
  let at = P_STATE + 8u;
  let pick = select_digit(lid, global_bin(HIST_P + 1536u, lid), vec2<u32>(load(at + 1u), load(at + 2u)));
  let theta_p = load(at) | pick.x;
  if (is_first(g, lid)) {
    atomicStore(&state[P_STATE + 12u], theta_p);
  }
  let base = g * SLICE + lid * ITEMS;
  var own = 0u;
  for (var e = 0u; e < ITEMS; e++) {
    let i = base + e;
    if (i < params.rows && key_at(i) >= theta_p) {
      own += weights[i];
    }
  }
  let kept = block_sum64(lid, vec2<u32>(own, 0u));
  if (lid == 0u) {
    atomicStore(&state[slice_word(g, 3u)], kept.x);
    atomicStore(&state[slice_word(g, 4u)], kept.y);
  }
}

// One workgroup: the greedy answer, or the draw over the kept mass in index order.
@compute @workgroup_size(256)
fn draw(@builtin(local_invocation_index) lid: u32) {
  let best = row_argmax(lid);
  let max_key = best.x;
  var chosen = best.y;
  var flags = 0u;
  if (max_key == NEG_INF_KEY) {
    flags |= FLAG_NO_FINITE;
  }
  let position = chunk.pos0 + params.positions;
  if (params.greedy != 0u || max_key == NEG_INF_KEY || max_key == POS_INF_KEY) {
    flags |= FLAG_GREEDY;
  } else {
    var theta_p = 0u;
    if (uses_top_p()) {
      theta_p = load(P_STATE + 12u);
    }
    // The slice: each invocation sums a run of slices, an exclusive scan places the runs.
    let per = (params.groups + THREADS - 1u) / THREADS;
    let first = lid * per;
    let last = min(first + per, params.groups);
    var own = vec2<u32>(0u, 0u);
    for (var g = first; g < last; g++) {
      own = add64(own, vec2<u32>(load(slice_word(g, 3u)), load(slice_word(g, 4u))));
    }
    let before = block_scan64(lid, own);
    let mass = block_sum64(lid, own);
    let goal = scale24(mass, draw24(params.seed, position)).xy;
    if (!less64(goal, before) && less64(goal, add64(before, own))) {
      var running = before;
      for (var g = first; g < last; g++) {
        let next = add64(running, vec2<u32>(load(slice_word(g, 3u)), load(slice_word(g, 4u))));
        if (less64(goal, next)) {
          let rest = sub64(goal, running);
          picked_slice = vec3<u32>(g, rest.x, rest.y);
          break;
        }
        running = next;
      }
    }
    let slice = workgroupUniformLoad(&picked_slice);

    // Inside the slice: the same placement over invocations, then the walk over items.
    let base = slice.x * SLICE + lid * ITEMS;
    var share = 0u;
    for (var e = 0u; e < ITEMS; e++) {
      let i = base + e;
      if (i < params.rows && key_at(i) >= theta_p) {
        share += weights[i];
      }
    }
    let start = block_scan64(lid, vec2<u32>(share, 0u));
    let rest = slice.yz;
    if (!less64(rest, start) && less64(rest, add64(start, vec2<u32>(share, 0u)))) {
      let rest_u32 = sub64(rest, start).x;
      var running = 0u;
      for (var e = 0u; e < ITEMS; e++) {
        let i = base + e;
        if (i < params.rows && key_at(i) >= theta_p) {
          running += weights[i];
          if (running > rest_u32) {
            picked = i;
            break;
          }
        }
      }
    }
    chosen = workgroupUniformLoad(&picked);
  }

  if (lid == 0u) {
    if (position < params.context) {
      tokens[position] = chosen;
      flags |= FLAG_WRITTEN;
    }
    result[0] = chosen;
    result[1] = flags;
    result[2] = position;
    result[3] = bitcast<u32>(logits[params.logits_offset + chosen]);
  }
}
