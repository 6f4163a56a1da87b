// mHC mix_down, lane weights and the block input norm (spec §4.4, §4.5 items 1-2, §4.7), one
// workgroup per position t:
//
//   hpre_j  = σ(a_pre·pre_j + b_pre_j + (+4 if j == active else −4))
//   u       = Σ_j hpre_j · X_t[j]
//   hpost_j = 2·σ(a_post·post_j + b_post_j + (0 if j == active else −4))
//   Hres    = Sinkhorn20(a_res·res + b_res)              (log domain, rows then columns, §3)
//   bx      = u + σ(⟨rms_unit(u), rms_unit(K)⟩ / sqrt(d))·V   at an Engram site, else u
//   hh      = prepare_input(ZCRMSNorm(bx; norm_in))
//
// `mix_dots` holds the raw phi products of the position: pre (n), post (n), res (n·n, row-major).
// Outputs go to the `state` scratch (u, bx, then hpost and Hres row-major) and to hh.
// Constants: GROUP, CAP (>= pad(d)), FWHT_SCALE (f32 of 1/sqrt(GROUP)). n <= MAX_LANES.

struct Params {
  lanes: u32,        // n
  width: u32,        // d
  d_pad: u32,        // pad(d), floats per position in hh
  active_lane: u32,       // active lane (block index mod n, §4.4, §10)
  lane_stride: u32,  // floats between positions in lanes
  lane_offset: u32,
  mix_stride: u32,   // floats between positions in mix
  mix_offset: u32,
  engram: u32,       // 1 at an Engram site: gate with K and V
  ekv_stride: u32,   // floats between positions in ekv
  key_offset: u32,   // float offset of the site's K in a position's ekv row
  ev_stride: u32,    // floats between positions in ev
  value_offset: u32, // float offset of the site's V in a position's ev row
  u_at: u32,         // state: u [T][d] at u_at
  bx_at: u32,        //        bx [T][d] at bx_at
  hmix_at: u32,      //        [T][n + n·n] (hpost, Hres) at hmix_at
  hh_stride: u32,
  hh_offset: u32,
  a_pre_at: u32,     // half offsets in fp16 of this layer's scalars and vectors
  a_post_at: u32,
  a_res_at: u32,
  b_pre_at: u32,
  b_post_at: u32,
  b_res_at: u32,
  norm_in_at: u32,
  sqrt_d: f32,       // f32 of sqrt(d) (§4.5 item 1)
  _pad0: u32,
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> lanes: array<f32>;
@group(0) @binding(2) var<storage, read> mix_dots: array<f32>;
@group(0) @binding(3) var<storage, read> fp16: array<u32>;
@group(0) @binding(4) var<storage, read> ekv: array<f32>;
@group(0) @binding(5) var<storage, read> ev: array<f32>;
@group(0) @binding(6) var<storage, read_write> state: array<f32>;
@group(0) @binding(7) var<storage, read_write> hh: array<f32>;

const THREADS: u32 = 256u;
const MAX_LANES: u32 = 16u;
const EPS: f32 = 1e-6;
const SINKHORN_ITERATIONS: u32 = 20u;

var<workgroup> fwht_buf: array<f32, CAP>;
var<workgroup> partial: array<vec4<f32>, THREADS>;
var<workgroup> log_mix: array<f32, MAX_LANES * MAX_LANES>;
var<workgroup> hpre: array<f32, MAX_LANES>;

//#include fp16.wgsl
//#include fwht.wgsl

fn sigmoid(x: f32) -> f32 {
  return 1.0 / (1.0 + exp(-x));
}

// Component-wise sum of one vec4 per invocation (tree order); every invocation gets the total.
fn workgroup_sum(lid: u32, value: vec4<f32>) -> vec4<f32> {
  partial[lid] = value;
  workgroupBarrier();
  for (var step = THREADS / 2u; step > 0u; step >>= 1u) {
    if (lid < step) {
      partial[lid] += partial[lid + step];
    }
    workgroupBarrier();
  }
  let total = workgroupUniformLoad(&partial[0]);
  workgroupBarrier();  // partial is reused by the next sum
  return total;
}

// One Sinkhorn half-step on log_mix: invocation `line` < n normalises row `line` (stride 1
// along the row, n between rows) or column `line` (stride n along, 1 between columns).
fn normalise_line(line: u32, n: u32, along: u32, across: u32) {
  let base = line * across;
  var top = log_mix[base];
  for (var k = 1u; k < n; k++) {
    top = max(top, log_mix[base + k * along]);
  }
  var total = 0.0;
  for (var k = 0u; k < n; k++) {
    total += exp(log_mix[base + k * along] - top);
  }
  let lse = top + log(total);
  for (var k = 0u; k < n; k++) {
    log_mix[base + k * along] -= lse;
  }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let t = wg.x;
  let n = params.lanes;
  let d = params.width;
  let mix_row = params.mix_offset + t * params.mix_stride;
  let hmix_row = params.hmix_at + t * (n + n * n);

  // Lane weights (§4.4, §4.7) and the Sinkhorn logits.
  if (lid < n) {
    let pre_off = select(-4.0, 4.0, lid == params.active_lane);
    hpre[lid] = sigmoid(half_at(params.a_pre_at) * mix_dots[mix_row + lid] + half_at(params.b_pre_at + lid) + pre_off);
    let post_off = select(-4.0, 0.0, lid == params.active_lane);
    let post = half_at(params.a_post_at) * mix_dots[mix_row + n + lid] + half_at(params.b_post_at + lid) + post_off;
    state[hmix_row + lid] = 2.0 * sigmoid(post);
  }
  if (lid < n * n) {
    log_mix[lid] = half_at(params.a_res_at) * mix_dots[mix_row + 2u * n + lid] + half_at(params.b_res_at + lid);
  }
  workgroupBarrier();

  // Sinkhorn20 (§3): every iteration normalises the rows, then the columns.
  for (var iteration = 0u; iteration < SINKHORN_ITERATIONS; iteration++) {
    if (lid < n) {
      normalise_line(lid, n, 1u, n);
    }
    workgroupBarrier();
    if (lid < n) {
      normalise_line(lid, n, n, 1u);
    }
    workgroupBarrier();
  }
  if (lid < n * n) {
    state[hmix_row + n + lid] = exp(log_mix[lid]);
  }

  // mix_down (§4.4): u = Σ_j hpre_j · X[j], lanes summed in order.
  let lane_row = params.lane_offset + t * params.lane_stride;
  var sums = vec4<f32>(0.0);
  for (var c = lid; c < d; c += THREADS) {
    var u = 0.0;
    for (var j = 0u; j < n; j++) {
      u += hpre[j] * lanes[lane_row + j * d + c];
    }
    state[params.u_at + t * d + c] = u;
    fwht_buf[c] = u;
    if (params.engram != 0u) {
      let key = ekv[t * params.ekv_stride + params.key_offset + c];
      sums += vec4<f32>(u * u, key * key, u * key, 0.0);
    }
  }

  // Engram gate (§4.5 item 1): ⟨u,K⟩·r_u·r_K equals the dot of the two rms_unit vectors.
  if (params.engram != 0u) {
    let total = workgroup_sum(lid, sums);
    let r_u = 1.0 / sqrt(total.x / f32(d) + EPS);
    let r_k = 1.0 / sqrt(total.y / f32(d) + EPS);
    let alpha = sigmoid(total.z * r_u * r_k / params.sqrt_d);
    for (var c = lid; c < d; c += THREADS) {
      fwht_buf[c] += alpha * ev[t * params.ev_stride + params.value_offset + c];
    }
  }

  // h = ZCRMSNorm(bx; norm_in) (§3), then prepare_input (§5.5.1).
  var squares = 0.0;
  for (var c = lid; c < d; c += THREADS) {
    let bx = fwht_buf[c];
    state[params.bx_at + t * d + c] = bx;
    squares += bx * bx;
  }
  let inv = 1.0 / sqrt(workgroup_sum(lid, vec4<f32>(squares, 0.0, 0.0, 0.0)).x / f32(d) + EPS);
  for (var c = lid; c < params.d_pad; c += THREADS) {
    var h = 0.0;
    if (c < d) {
      h = (1.0 + half_at(params.norm_in_at + c)) * fwht_buf[c] * inv;
    }
    fwht_buf[c] = h;
  }
  fwht_groups(lid, THREADS, params.d_pad, GROUP, FWHT_SCALE);
  let hh_row = params.hh_offset + t * params.hh_stride;
  for (var c = lid; c < params.d_pad; c += THREADS) {
    hh[hh_row + c] = fwht_buf[c];
  }
}
