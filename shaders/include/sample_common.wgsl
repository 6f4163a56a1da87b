// What both samplers share (sample.wgsl, sample_staged.wgsl): the key of a logit, the fixed-point
// weight, the counter-based draw and 64-bit integers as vec2<u32>(low, high). The definition is
// needle_wgpu/reference/sampling.py. Included by kernels that define THREADS (256).

const NONE: u32 = 0xFFFFFFFFu;
const NEG_INF_KEY: u32 = 0x007FFFFFu;  // order_key(-inf) and of NaN; 0 marks padding past `rows`
const POS_INF_KEY: u32 = 0xFF800000u;
const WEIGHT_ONE: u32 = 16777216u;     // weights are multiples of 2^-24 of the largest one
const FLAG_WRITTEN: u32 = 1u;
const FLAG_GREEDY: u32 = 2u;
const FLAG_NO_FINITE: u32 = 4u;

// Constrained decoding (MASKED): bit i of mask word i / 32 allows id i. A disallowed id reads as
// -inf, and the argmax looks at allowed ids only (reference/sampling.py).
fn allowed(i: u32) -> bool {
  if (MASKED) {
    return ((mask[i >> 5u] >> (i & 31u)) & 1u) != 0u;
  }
  return true;
}

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

// The value a weight uses: subnormals read as 0, as a GPU may flush them anyway.
fn weight_value(key: u32) -> f32 {
  let v = key_value(key);
  return select(v, 0.0, (bitcast<u32>(v) & 0x7F800000u) == 0u);
}

// (a · b) >> 31 for Q31 products.
fn mulq(a: u32, b: u32) -> u32 {
  let p = mul32(a, b);
  return (p.y << 1u) | (p.x >> 31u);
}

// 2^24 · e^(-z / 2^24) within one unit, for 0 <= z <= 17 · 2^24, in integers only (the
// reference's fixed_exp): t = z · log2(e); 2^-t = 2^-floor(t) · 2^-a/16 (table) · e^-s, s < ln2/16
// by four Taylor terms, in Q31. Constants (pipeline constants from needle_wgpu/sampling.py):
// LOG2E_Q30, LN2_Q31, EXP_C3, EXP_C4, EXP2_0 … EXP2_15, EXP_CUT.
var<private> exp2_sixteenths: array<u32, 16> = array<u32, 16>(
  EXP2_0, EXP2_1, EXP2_2, EXP2_3, EXP2_4, EXP2_5, EXP2_6, EXP2_7,
  EXP2_8, EXP2_9, EXP2_10, EXP2_11, EXP2_12, EXP2_13, EXP2_14, EXP2_15);

fn fixed_exp(z: u32) -> u32 {
  let tz = mul32(z, LOG2E_Q30);
  let t = (tz.y << 2u) | (tz.x >> 30u);
  let sb = mul32(t & 0xFFFFFu, LN2_Q31);
  let s = (sb.y << 8u) | (sb.x >> 24u);
  let h3 = EXP_C3 - mulq(s, EXP_C4);
  let h2 = 0x40000000u - mulq(s, h3);
  let h1 = 0x80000000u - mulq(s, h2);
  let p = 0x80000000u - mulq(s, h1);
  return mulq(exp2_sixteenths[(t >> 20u) & 15u], p) >> (7u + (t >> 24u));
}

// A candidate's weight: (l - max) · scale is x · 2^24 (scale = 2^24 / T), one exact float32
// subtract and multiply; then fixed_exp. `top` = weight_value(max key).
fn weight_of(key: u32, top: f32, scale: f32) -> u32 {
  if (key == NEG_INF_KEY) {
    return 0u;
  }
  let x = (weight_value(key) - top) * scale;
  if (x >= -f32(EXP_CUT * 16777216u)) {
    return fixed_exp(u32(-x));
  }
  return 0u;
}

fn pcg_hash(x: u32) -> u32 {
  let state = x * 747796405u + 2891336453u;
  let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
  return (word >> 22u) ^ word;
}

// The 24 random bits of the draw for the token at `position`.
fn draw24(seed: u32, position: u32) -> u32 {
  return pcg_hash(seed ^ pcg_hash(position)) >> 8u;
}

fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  let low = a.x + b.x;
  return vec2<u32>(low, a.y + b.y + select(0u, 1u, low < a.x));
}

fn sub64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  return vec2<u32>(a.x - b.x, a.y - b.y - select(0u, 1u, a.x < b.x));
}

fn less64(a: vec2<u32>, b: vec2<u32>) -> bool {
  return a.y < b.y || (a.y == b.y && a.x < b.x);
}

// The full 64-bit product of two u32, from 16-bit halves.
fn mul32(a: u32, b: u32) -> vec2<u32> {
  let al = a & 0xFFFFu;
  let ah = a >> 16u;
  let bl = b & 0xFFFFu;
  let bh = b >> 16u;
  let cross = vec2<u32>(al * bh, 0u);
  let middle = add64(cross, vec2<u32>(ah * bl, 0u));  // up to 33 bits
  let low = vec2<u32>(al * bl, ah * bh);
  return add64(low, vec2<u32>(middle.x << 16u, (middle.x >> 16u) | (middle.y << 16u)));
}

// x · f / 2^24 for f < 2^24: (floor of it, whether it was exact). x · f < 2^88.
fn scale24(x: vec2<u32>, f: u32) -> vec3<u32> {
  let low = mul32(x.x, f);   // bits 0..55
  let high = mul32(x.y, f);  // bits 32..87
  let w1 = low.y + high.x;
  let w2 = high.y + select(0u, 1u, w1 < low.y);
  let exact = select(0u, 1u, (low.x & 0xFFFFFFu) == 0u);
  return vec3<u32>((low.x >> 24u) | (w1 << 8u), (w1 >> 24u) | (w2 << 8u), exact);
}

// Step 5's target: max(1, ceil(p · total / 2^24)).
fn nucleus_target(total: vec2<u32>, p_fixed: u32) -> vec2<u32> {
  let scaled = scale24(total, p_fixed);
  var goal_mass = scaled.xy;
  if (scaled.z == 0u) {
    goal_mass = add64(goal_mass, vec2<u32>(1u, 0u));
  }
  if (goal_mass.x == 0u && goal_mass.y == 0u) {
    goal_mass = vec2<u32>(1u, 0u);
  }
  return goal_mass;
}

// Workgroup reductions in two levels, 16 rows of 16 invocations: CPU adapters run a workgroup
// on one thread and pay for every barrier, so each of these takes three or four where a tree
// takes 8 to 16. `rows64[r]` is the sum of invocations [16r, 16r + 16).
const ROW: u32 = 16u;

var<workgroup> red64: array<vec2<u32>, THREADS>;
var<workgroup> rows64: array<vec2<u32>, ROW>;
var<workgroup> shared64: vec2<u32>;

fn sum_rows64(lid: u32) {
  if (lid < ROW) {
    var total = vec2<u32>(0u, 0u);
    for (var m = 0u; m < ROW; m++) {
      total = add64(total, red64[lid * ROW + m]);
    }
    rows64[lid] = total;
  }
}

// Σ over the workgroup of one u64 per invocation; the same value everywhere. A following call
// may start at once: every invocation reads the total only after the stores it depends on.
fn block_sum64(lid: u32, value: vec2<u32>) -> vec2<u32> {
  red64[lid] = value;
  workgroupBarrier();
  sum_rows64(lid);
  workgroupBarrier();
  if (lid == 0u) {
    var total = vec2<u32>(0u, 0u);
    for (var r = 0u; r < ROW; r++) {
      total = add64(total, rows64[r]);
    }
    shared64 = total;
  }
  return workgroupUniformLoad(&shared64);
}

// Exclusive prefix sum over invocations in index order.
fn block_scan64(lid: u32, value: vec2<u32>) -> vec2<u32> {
  red64[lid] = value;
  workgroupBarrier();
  sum_rows64(lid);
  workgroupBarrier();
  let row = lid / ROW;
  var before = vec2<u32>(0u, 0u);
  for (var r = 0u; r < row; r++) {
    before = add64(before, rows64[r]);
  }
  for (var m = row * ROW; m < lid; m++) {
    before = add64(before, red64[m]);
  }
  workgroupBarrier();  // a following call may overwrite red64 and rows64
  return before;
}

var<workgroup> red_pairs: array<vec2<u32>, THREADS>;
var<workgroup> row_pairs: array<vec2<u32>, ROW>;
var<workgroup> shared_pair: vec2<u32>;

// Of two (key, index) pairs, the larger key, or the lower index on equal keys.
fn better(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  return select(a, b, b.x > a.x || (b.x == a.x && b.y < a.y));
}

// The largest key with its lowest index, over the workgroup; the same everywhere.
fn block_argmax(lid: u32, key: u32, index: u32) -> vec2<u32> {
  red_pairs[lid] = vec2<u32>(key, index);
  workgroupBarrier();
  if (lid < ROW) {
    var best = red_pairs[lid * ROW];
    for (var m = 1u; m < ROW; m++) {
      best = better(best, red_pairs[lid * ROW + m]);
    }
    row_pairs[lid] = best;
  }
  workgroupBarrier();
  if (lid == 0u) {
    var best = row_pairs[0];
    for (var r = 1u; r < ROW; r++) {
      best = better(best, row_pairs[r]);
    }
    shared_pair = best;
  }
  return workgroupUniformLoad(&shared_pair);
}

// The radix step shared by top-k (counts) and top-p (weights): invocation `lid` holds bin `lid`'s
// sum; the digit d with Σ_{bins > d} < remaining <= Σ_{bins >= d}, and remaining - Σ_{bins > d}.
// Returns (digit, remaining low, remaining high); the same everywhere. Such a digit exists when
// 0 < remaining <= Σ bins.
var<workgroup> chosen_digit: vec3<u32>;

fn select_digit(lid: u32, bin: vec2<u32>, remaining: vec2<u32>) -> vec3<u32> {
  red64[lid] = bin;
  workgroupBarrier();
  sum_rows64(lid);
  workgroupBarrier();
  if (lid == 0u) {
    var above = vec2<u32>(0u, 0u);
    var row = 0u;
    for (var r = ROW; r > 0u; r--) {
      let next = add64(above, rows64[r - 1u]);
      if (!less64(next, remaining)) {
        row = r - 1u;
        break;
      }
      above = next;
    }
    var digit = row * ROW;
    for (var m = row * ROW + ROW; m > row * ROW; m--) {
      let next = add64(above, red64[m - 1u]);
      if (!less64(next, remaining)) {
        digit = m - 1u;
        break;
      }
      above = next;
    }
    let rest = sub64(remaining, above);
    chosen_digit = vec3<u32>(digit, rest.x, rest.y);
  }
  return workgroupUniformLoad(&chosen_digit);
}

// A workgroup histogram of 256 u64 bins (low, high words), for counts or weights.
var<workgroup> hist: array<atomic<u32>, 512>;

fn hist_clear(lid: u32) {
  atomicStore(&hist[2u * lid], 0u);
  atomicStore(&hist[2u * lid + 1u], 0u);
}

fn hist_add(bin: u32, value: u32) {
  let old = atomicAdd(&hist[2u * bin], value);
  if (old + value < old) {
    atomicAdd(&hist[2u * bin + 1u], 1u);
  }
}

fn hist_bin(lid: u32) -> vec2<u32> {
  return vec2<u32>(atomicLoad(&hist[2u * lid]), atomicLoad(&hist[2u * lid + 1u]));
}
