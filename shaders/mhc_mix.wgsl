// mHC mix_down, lane weights and the block input norm (spec §4.4, §4.5 items 1-2, §4.7), one
// workgroup per position t:
//
//   hpre_j  = σ(a_pre·pre_j + b_pre_j + (+4 if j == active else −4))
//   u       = Σ_j hpre_j · X_t[j]
//   hpost_j = 2·σ(a_post·post_j + b_post_j + (0 if j == active else −4))
//   Hres    = Sinkhorn20(a_res·res + b_res)              (log domain, rows then columns, §3)
//   bx      = u + σ(⟨rms_unit(u), rms_unit(K)⟩ / sqrt(d))·V   at an Engram site (ENGRAM), else u
//   hh      = prepare_input(ZCRMSNorm(bx; norm_in))
//
// `mix_dots` holds the raw phi products of the position: pre (n), post (n), res (n·n, row-major).
// Outputs go to the `state` scratch (u, bx, then hpost and Hres row-major) and to hh.
// Invocation lid owns channels 4q .. 4q+3 of each slot q = lid + THREADS·k.
//
// Sizes and the Engram switch are constants, never uniforms: lavapipe (Mesa 22.3) re-optimises and
// recompiles a shader at every dispatch when a branch or loop bound depends on uniform values
// alone ("inlined uniforms"), which cost more than the kernel itself.
// Constants: GROUP, LANES (n), WIDTH (d, a multiple of 4), ENGRAM, FWHT_SCALE (f32 of 1/sqrt(GROUP)),
// ACT_QUANT (deploy numerics: hh = prepare_input(A8(ZCRMSNorm(bx; norm_in))), §4.9 point 3).

struct Params {
  active_lane: u32,  // active lane (block index mod n, §4.4, §10)
  lane_stride: u32,  // floats between positions in lanes
  lane_offset: u32,
  mix_stride: u32,   // floats between positions in mix
  mix_offset: u32,
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
  norm_in_at: u32,   // even (the store aligns every tensor to 4 bytes)
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
const EPS: f32 = 1e-6;
const SINKHORN_ITERATIONS: u32 = 20u;
const D_PAD: u32 = (WIDTH + GROUP - 1u) / GROUP * GROUP;  // pad(d): floats per position in hh
const CHANNEL_SLOTS: u32 = WIDTH / 4u;
const PER_THREAD: u32 = (D_PAD / 4u + THREADS - 1u) / THREADS;
const HMIX: u32 = LANES + LANES * LANES;

var<workgroup> fwht_buf: array<f32, D_PAD>;
var<workgroup> hpre: array<f32, LANES>;

//#include include/fp16.wgsl
//#include include/workgroup_sum.wgsl
//#include include/fwht.wgsl
//#include include/act_quant.wgsl

fn lanes4(at: u32) -> vec4<f32> {
  return vec4<f32>(lanes[at], lanes[at + 1u], lanes[at + 2u], lanes[at + 3u]);
}

fn ekv4(at: u32) -> vec4<f32> {
  return vec4<f32>(ekv[at], ekv[at + 1u], ekv[at + 2u], ekv[at + 3u]);
}

fn ev4(at: u32) -> vec4<f32> {
  return vec4<f32>(ev[at], ev[at + 1u], ev[at + 2u], ev[at + 3u]);
}

fn store_state4(at: u32, value: vec4<f32>) {
  state[at] = value.x;
  state[at + 1u] = value.y;
  state[at + 2u] = value.z;
  state[at + 3u] = value.w;
}

fn sigmoid(x: f32) -> f32 {
  return 1.0 / (1.0 + exp(-x));
}


// One Sinkhorn half-step on the n x n logits in registers: normalise line `line` (stride `along`
// inside the line, `across` between lines): rows are (1, n), columns (n, 1).
fn normalise_line(m: ptr<function, array<f32, LANES * LANES>>, line: u32, along: u32, across: u32) {
  let base = line * across;
  var top = (*m)[base];
  for (var k = 1u; k < LANES; k++) {
    top = max(top, (*m)[base + k * along]);
  }
  var total = 0.0;
  for (var k = 0u; k < LANES; k++) {
    total += exp((*m)[base + k * along] - top);
  }
  let lse = top + log(total);
  for (var k = 0u; k < LANES; k++) {
    (*m)[base + k * along] -= lse;
  }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let t = wg.x;
  let mix_row = params.mix_offset + t * params.mix_stride;
  let hmix_row = params.hmix_at + t * HMIX;

  // Lane weights (§4.4, §4.7).
  if (lid < LANES) {
    let pre_off = select(-4.0, 4.0, lid == params.active_lane);
    hpre[lid] = sigmoid(half_at(params.a_pre_at) * mix_dots[mix_row + lid] + half_at(params.b_pre_at + lid) + pre_off);
    let post_off = select(-4.0, 0.0, lid == params.active_lane);
    let post = half_at(params.a_post_at) * mix_dots[mix_row + LANES + lid] + half_at(params.b_post_at + lid) + post_off;
    state[hmix_row + lid] = 2.0 * sigmoid(post);
  }
  workgroupBarrier();

  // mix_down (§4.4): u = Σ_j hpre_j · X[j], lanes summed in order.
  let lane_row = params.lane_offset + t * params.lane_stride;
  var bx: array<vec4<f32>, PER_THREAD>;
  var sums = vec4<f32>(0.0);
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    bx[k] = vec4<f32>(0.0);
    if (q < CHANNEL_SLOTS) {
      let c = 4u * q;
      var u = vec4<f32>(0.0);
      for (var j = 0u; j < LANES; j++) {
        u += hpre[j] * lanes4(lane_row + j * WIDTH + c);
      }
      store_state4(params.u_at + t * WIDTH + c, u);
      bx[k] = u;
      if (ENGRAM) {
        let key = ekv4(t * params.ekv_stride + params.key_offset + c);
        sums += vec4<f32>(dot(u, u), dot(key, key), dot(u, key), 0.0);
      }
    }
  }

  // Engram gate (§4.5 item 1): ⟨u,K⟩·r_u·r_K equals the dot of the two rms_unit vectors.
  if (ENGRAM) {
    let total = workgroup_sum(lid, sums);
    let r_u = 1.0 / sqrt(total.x / f32(WIDTH) + EPS);
    let r_k = 1.0 / sqrt(total.y / f32(WIDTH) + EPS);
    let alpha = sigmoid(total.z * r_u * r_k / params.sqrt_d);
    for (var k = 0u; k < PER_THREAD; k++) {
      let q = lid + k * THREADS;
      if (q < CHANNEL_SLOTS) {
        bx[k] += alpha * ev4(t * params.ev_stride + params.value_offset + 4u * q);
      }
    }
  }

  // h = ZCRMSNorm(bx; norm_in) (§3), then prepare_input (§5.5.1).
  var squares = 0.0;
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    if (q < CHANNEL_SLOTS) {
      store_state4(params.bx_at + t * WIDTH + 4u * q, bx[k]);
      squares += dot(bx[k], bx[k]);
    }
  }
  let inv = 1.0 / sqrt(workgroup_sum(lid, vec4<f32>(squares, 0.0, 0.0, 0.0)).x / f32(WIDTH) + EPS);
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    if (q < D_PAD / 4u) {
      var h = vec4<f32>(0.0);
      if (q < CHANNEL_SLOTS) {
        h = (1.0 + half4_at(params.norm_in_at + 4u * q)) * bx[k] * inv;
      }
      fwht_buf[4u * q] = h.x;
      fwht_buf[4u * q + 1u] = h.y;
      fwht_buf[4u * q + 2u] = h.z;
      fwht_buf[4u * q + 3u] = h.w;
    }
  }
  if (ACT_QUANT) {
    act_quant(lid, THREADS, WIDTH);
  }
  fwht_groups(lid, THREADS, D_PAD, GROUP, FWHT_SCALE);
  let hh_row = params.hh_offset + t * params.hh_stride;
  for (var c = lid; c < D_PAD; c += THREADS) {
    hh[hh_row + c] = fwht_buf[c];
  }

  // Sinkhorn20 (§3) of the res logits, by one invocation in registers: n x n is tiny, and last,
  // since nothing else in the workgroup waits for it. Every iteration normalises rows, then columns.
  if (lid == 0u) {
    var m: array<f32, LANES * LANES>;
    let a_res = half_at(params.a_res_at);
    for (var e = 0u; e < LANES * LANES; e++) {
      m[e] = a_res * mix_dots[mix_row + 2u * LANES + e] + half_at(params.b_res_at + e);
    }
    for (var iteration = 0u; iteration < SINKHORN_ITERATIONS; iteration++) {
      for (var line = 0u; line < LANES; line++) {
        normalise_line(&m, line, 1u, LANES);
      }
      for (var line = 0u; line < LANES; line++) {
        normalise_line(&m, line, LANES, 1u);
      }
    }
    for (var e = 0u; e < LANES * LANES; e++) {
      state[hmix_row + LANES + e] = exp(m[e]);
    }
  }
}
