// What both samplers share (sample.wgsl, sample_staged.wgsl): the key of a logit, the fixed-point
// weight, the counter-based draw and 64-bit integers as vec2<u32>(low, high). The definition is
// needle_wgpu/reference/sampling.py. Included by kernels that define THREADS (256).

const NONE: u32 = 0xFFFFFFFFu;
const NEG_INF_KEY: u32 = 0x007FFFFFu;  // order_key(-inf) and of NaN; 0 marks padding past `rows`
const POS_INF_KEY: u32 = 0xFF800000u;
const WEIGHT_ONE: f32 = 16777216.0;    // weights are multiples of 2^-24 of the largest one
const WEIGHT_CUT: f32 = -17.0;         // exp(x) · 2^24 < 1 below it
const FLAG_WRITTEN: u32 = 1u;
const FLAG_GREEDY: u32 = 2u;
const FLAG_NO_FINITE: u32 = 4u;

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

// floor(exp((l - top) · inverse_temperature) · 2^24); a subtract and a multiply are exact in WGSL.
fn weight_of(key: u32, top: f32, inverse_temperature: f32) -> u32 {
  if (key == NEG_INF_KEY) {
    return 0u;
  }
  let x = (key_value(key) - top) * inverse_temperature;
  if (x >= WEIGHT_CUT) {
    return u32(exp(x) * WEIGHT_ONE);
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

var<workgroup> red64: array<vec2<u32>, THREADS>;
var<workgroup> shared64: vec2<u32>;

// Σ over the workgroup of one u64 per invocation; the same value everywhere.
fn block_sum64(lid: u32, value: vec2<u32>) -> vec2<u32> {
  red64[lid] = value;
  workgroupBarrier();
  for (var span = THREADS / 2u; span > 0u; span >>= 1u) {
    if (lid < span) {
      red64[lid] = add64(red64[lid], red64[lid + span]);
    }
    workgroupBarrier();
  }
  if (lid == 0u) {
    shared64 = red64[0];
  }
  return workgroupUniformLoad(&shared64);
}

// Exclusive prefix sum over invocations in order (Hillis-Steele), or the suffix sum of the
// invocations above when `reverse`.
fn block_scan64(lid: u32, value: vec2<u32>, reverse: bool) -> vec2<u32> {
  red64[lid] = value;
  workgroupBarrier();
  for (var offset = 1u; offset < THREADS; offset <<= 1u) {
    var v = red64[lid];
    if (reverse && lid + offset < THREADS) {
      v = add64(v, red64[lid + offset]);
    }
    if (!reverse && lid >= offset) {
      v = add64(v, red64[lid - offset]);
    }
    workgroupBarrier();
    red64[lid] = v;
    workgroupBarrier();
  }
  let inclusive = red64[lid];
  workgroupBarrier();  // a following call may overwrite red64
  return sub64(inclusive, value);
}

// The radix step shared by top-k (counts) and top-p (weights): invocation `lid` holds bin `lid`'s
// sum; the digit d with Σ_{bins > d} < remaining <= Σ_{bins >= d}, and remaining - Σ_{bins > d}.
// Returns (digit, remaining low, remaining high); the same everywhere.
var<workgroup> chosen_digit: vec3<u32>;

fn select_digit(lid: u32, bin: vec2<u32>, remaining: vec2<u32>) -> vec3<u32> {
  let above = block_scan64(lid, bin, true);
  let at_or_above = add64(above, bin);
  if (less64(above, remaining) && !less64(at_or_above, remaining)) {
    let rest = sub64(remaining, above);
    chosen_digit = vec3<u32>(lid, rest.x, rest.y);
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
