// The block tail (spec §4.5 items 10-13, §4.6, §4.7, §4.8), one workgroup per position t:
//
//   bx += σ(attn_gate) · ZCRMSNorm(a; post_norm)          a = the out_proj product
//   x   = ZCRMSNorm(bx; pre_hada)
//   bx += HadaMLP(x)                                        (§4.6, three Kronecker stages)
//   y   = bx − u
//   X'[i] = Σ_j Hres[i, j]·X[j] + hpost_i·y                 (scatter_up, in place in lanes)
//   cells[t][cell] = (1/n)·Σ_j X'[j]                        (when WRITE_CELL)
//
// Invocation lid owns the four consecutive elements of each vec4 slot q = lid + THREADS·k: channels
// 4q .. 4q+3 while 4q < d, and the same HadaMLP elements. So each FP16 vector is read as word pairs
// and the elementwise steps need no barrier. `work` holds two hada vectors as vec4 slots: the
// current one and the scratch of the Kronecker passes and gathers.
//
// Sizes are constants, never uniforms: lavapipe (Mesa 22.3) re-optimises and recompiles a shader
// at every dispatch when a branch or loop bound depends on uniform values alone ("inlined
// uniforms"), which cost more than the kernel itself.
// Constants: WIDTH (d), LANES (n), BA, BB (hada_n = BA·BB), RANK (r), WRITE_CELL. d, BA and BB are
// multiples of 4; every FP16 tensor starts at an even half offset (the store aligns them to 4 bytes).

struct Params {
  lane_stride: u32,   // floats between positions in lanes
  lane_offset: u32,
  a_stride: u32,      // floats between positions in a
  a_offset: u32,
  u_at: u32,          // state: u [T][d], bx [T][d], hmix [T][n + n·n] (written by mhc_mix)
  bx_at: u32,
  hmix_at: u32,
  cell_stride: u32,   // floats between positions in cells
  cell_offset: u32,   // float offset of this layer's cell at position 0
  post_norm_at: u32,  // half offsets in fp16 of this layer's parameters
  attn_gate_at: u32,
  pre_hada_at: u32,
  d1_at: u32,
  d2_at: u32,
  b2_at: u32,
  d3_at: u32,
  d4_at: u32,
  w1a_at: u32,
  w1b_at: u32,
  w2a_at: u32,
  w2b_at: u32,
  w3a_at: u32,
  w3b_at: u32,
  cond_v_at: u32,
  cond_u_at: u32,
  p1_at: u32,         // word offsets of the permutations in perm
  p2_at: u32,
  _pad0: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> attn: array<f32>;
@group(0) @binding(2) var<storage, read> state: array<f32>;
@group(0) @binding(3) var<storage, read_write> lanes: array<f32>;
@group(0) @binding(4) var<storage, read> fp16: array<u32>;
@group(0) @binding(5) var<storage, read> perm: array<u32>;
@group(0) @binding(6) var<storage, read_write> cells: array<f32>;

const THREADS: u32 = 256u;
const EPS: f32 = 1e-6;
const HADA_N: u32 = BA * BB;
const SLOTS: u32 = HADA_N / 4u;                   // vec4 slots of one hada vector
const CHANNEL_SLOTS: u32 = WIDTH / 4u;
const PER_THREAD: u32 = (SLOTS + THREADS - 1u) / THREADS;
const TILES: u32 = HADA_N / 16u;                  // 4 x 4 output tiles of one Kronecker pass
const RANK_SLOTS: u32 = (RANK + 3u) / 4u;
const HMIX: u32 = LANES + LANES * LANES;

var<workgroup> work: array<vec4<f32>, 2u * SLOTS>;

//#include include/fp16.wgsl
//#include include/workgroup_sum.wgsl

fn attn4(at: u32) -> vec4<f32> {
  return vec4<f32>(attn[at], attn[at + 1u], attn[at + 2u], attn[at + 3u]);
}

fn state4(at: u32) -> vec4<f32> {
  return vec4<f32>(state[at], state[at + 1u], state[at + 2u], state[at + 3u]);
}

fn lanes4(at: u32) -> vec4<f32> {
  return vec4<f32>(lanes[at], lanes[at + 1u], lanes[at + 2u], lanes[at + 3u]);
}

fn store_lanes4(at: u32, value: vec4<f32>) {
  lanes[at] = value.x;
  lanes[at + 1u] = value.y;
  lanes[at + 2u] = value.z;
  lanes[at + 3u] = value.w;
}

// One element of the hada vectors in `work` (element i of the whole array).
fn work_at(i: u32) -> f32 {
  return work[i >> 2u][i & 3u];
}

fn sigmoid(x: vec4<f32>) -> vec4<f32> {
  return 1.0 / (1.0 + exp(-x));
}


// work slots [src, src + SLOTS) <- Kron(them; A, B) (§4.6), slots [tmp, tmp + SLOTS) as scratch.
// Each invocation computes 4 x 4 outputs, reading A or B four halves (two words) at a time.
fn kron(lid: u32, src: u32, tmp: u32, a_at: u32, b_at: u32) {
  workgroupBarrier();
  // T = Aᵀ·Z: T[k][j] = Σ_i A[i][k]·Z[i][j], i ascending. Stored transposed (Tᵀ is [BB][BA]) so
  // the second pass reads T[k .. k+3][j] as one slot.
  for (var tile = lid; tile < TILES; tile += THREADS) {
    let k0 = tile / (BB / 4u) * 4u;
    let j0 = tile % (BB / 4u) * 4u;
    var t0 = vec4<f32>(0.0);
    var t1 = vec4<f32>(0.0);
    var t2 = vec4<f32>(0.0);
    var t3 = vec4<f32>(0.0);
    for (var i = 0u; i < BA; i++) {
      let a = half4_at(a_at + i * BA + k0);    // A[i][k0 .. k0+3]
      let z = work[src + (i * BB + j0) / 4u];  // Z[i][j0 .. j0+3]
      t0 += a.x * z;
      t1 += a.y * z;
      t2 += a.z * z;
      t3 += a.w * z;
    }
    let at = tmp + (j0 * BA + k0) / 4u;
    work[at] = vec4<f32>(t0.x, t1.x, t2.x, t3.x);
    work[at + BA / 4u] = vec4<f32>(t0.y, t1.y, t2.y, t3.y);
    work[at + BA / 2u] = vec4<f32>(t0.z, t1.z, t2.z, t3.z);
    work[at + 3u * BA / 4u] = vec4<f32>(t0.w, t1.w, t2.w, t3.w);
  }
  workgroupBarrier();
  // out = T·B: out[k][l] = Σ_j T[k][j]·B[j][l], j ascending, back into src row-major.
  for (var tile = lid; tile < TILES; tile += THREADS) {
    let k0 = tile / (BB / 4u) * 4u;
    let l0 = tile % (BB / 4u) * 4u;
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    for (var j = 0u; j < BB; j++) {
      let tk = work[tmp + (j * BA + k0) / 4u];  // T[k0 .. k0+3][j]
      let b = half4_at(b_at + j * BB + l0);     // B[j][l0 .. l0+3]
      o0 += tk.x * b;
      o1 += tk.y * b;
      o2 += tk.z * b;
      o3 += tk.w * b;
    }
    let at = src + (k0 * BB + l0) / 4u;
    work[at] = o0;
    work[at + BB / 4u] = o1;
    work[at + BB / 2u] = o2;
    work[at + 3u * BB / 4u] = o3;
  }
  workgroupBarrier();
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let t = wg.x;
  let a_row = params.a_offset + t * params.a_stride;
  let bx_row = params.bx_at + t * WIDTH;

  // Items 10-11: bx += σ(attn_gate) · ZCRMSNorm(a; post_norm).
  var a: array<vec4<f32>, PER_THREAD>;
  var bx: array<vec4<f32>, PER_THREAD>;
  var squares = 0.0;
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    a[k] = vec4<f32>(0.0);
    if (q < CHANNEL_SLOTS) {
      a[k] = attn4(a_row + 4u * q);
      squares += dot(a[k], a[k]);
    }
  }
  let inv_a = 1.0 / sqrt(workgroup_sum(lid, vec4<f32>(squares, 0.0, 0.0, 0.0)).x / f32(WIDTH) + EPS);
  let gate = 1.0 / (1.0 + exp(-half_at(params.attn_gate_at)));
  squares = 0.0;
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    bx[k] = vec4<f32>(0.0);
    if (q < CHANNEL_SLOTS) {
      let normed = (1.0 + half4_at(params.post_norm_at + 4u * q)) * a[k] * inv_a;
      bx[k] = state4(bx_row + 4u * q) + gate * normed;
      squares += dot(bx[k], bx[k]);
    }
  }

  // Item 12 input: x = ZCRMSNorm(bx; pre_hada); z = pad(x) ⊙ d1 into work[0 ..]; and this
  // invocation's share of the cond logits x·cond_v (§4.6 step 1).
  let inv_b = 1.0 / sqrt(workgroup_sum(lid, vec4<f32>(squares, 0.0, 0.0, 0.0)).x / f32(WIDTH) + EPS);
  var logits: array<f32, RANK>;
  for (var j = 0u; j < RANK; j++) {
    logits[j] = 0.0;
  }
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    if (q < SLOTS) {
      var x = vec4<f32>(0.0);
      if (q < CHANNEL_SLOTS) {
        x = (1.0 + half4_at(params.pre_hada_at + 4u * q)) * bx[k] * inv_b;
        // cond_v rows 4q .. 4q+3 are 4·RANK consecutive halves: read them a word at a time.
        let row = (params.cond_v_at + 4u * q * RANK) >> 1u;
        for (var w = 0u; w < 2u * RANK; w++) {
          let pair = unpack2x16float(fp16[row + w]);
          logits[(2u * w) % RANK] += x[2u * w / RANK] * pair.x;
          logits[(2u * w + 1u) % RANK] += x[(2u * w + 1u) / RANK] * pair.y;
        }
      }
      work[q] = x * half4_at(params.d1_at + 4u * q);
    }
  }

  // cond = 1 + softmax(logits)·cond_u, j ascending (§4.6 step 1). Every invocation gets the
  // totals and computes the softmax itself (r values), so no barrier waits on one invocation.
  var weights: array<f32, RANK>;
  for (var s = 0u; s < RANK_SLOTS; s++) {
    var part = vec4<f32>(0.0);
    for (var m = 0u; m < 4u; m++) {
      if (4u * s + m < RANK) {
        part[m] = logits[4u * s + m];
      }
    }
    let total = workgroup_sum(lid, part);
    for (var m = 0u; m < 4u; m++) {
      if (4u * s + m < RANK) {
        weights[4u * s + m] = total[m];
      }
    }
  }
  var top = weights[0];
  for (var j = 1u; j < RANK; j++) {
    top = max(top, weights[j]);
  }
  var total = 0.0;
  for (var j = 0u; j < RANK; j++) {
    weights[j] = exp(weights[j] - top);
    total += weights[j];
  }
  var cond: array<vec4<f32>, PER_THREAD>;
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    cond[k] = vec4<f32>(0.0);
    if (q < SLOTS) {
      var acc = vec4<f32>(0.0);
      for (var j = 0u; j < RANK; j++) {
        acc += (weights[j] / total) * half4_at(params.cond_u_at + j * HADA_N + 4u * q);
      }
      cond[k] = 1.0 + acc;
    }
  }

  // Steps 3-4: Kron 1, gather by p1, silu((d2·cond)·z + b2) into work[SLOTS ..].
  kron(lid, 0u, SLOTS, params.w1a_at, params.w1b_at);
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    if (q < SLOTS) {
      let p = params.p1_at + 4u * q;
      let z = vec4<f32>(work_at(perm[p]), work_at(perm[p + 1u]), work_at(perm[p + 2u]), work_at(perm[p + 3u]));
      let pre = (half4_at(params.d2_at + 4u * q) * cond[k]) * z + half4_at(params.b2_at + 4u * q);
      work[SLOTS + q] = pre * sigmoid(pre);
    }
  }
  // Steps 5-6: Kron 2, gather by p2, ⊙ d3 into work[0 ..], Kron 3.
  kron(lid, SLOTS, 0u, params.w2a_at, params.w2b_at);
  for (var k = 0u; k < PER_THREAD; k++) {
    let q = lid + k * THREADS;
    if (q < SLOTS) {
      let p = params.p2_at + 4u * q;
      let z = vec4<f32>(work_at(4u * SLOTS + perm[p]), work_at(4u * SLOTS + perm[p + 1u]),
                        work_at(4u * SLOTS + perm[p + 2u]), work_at(4u * SLOTS + perm[p + 3u]));
      work[q] = z * half4_at(params.d3_at + 4u * q);
    }
  }
  kron(lid, 0u, SLOTS, params.w3a_at, params.w3b_at);

  // Step 7 and items 12-13: bx += (z ⊙ d4)[0:d]; y = bx − u; then scatter_up (§4.7) and the
  // cell (§4.8). Each invocation owns its channels in every lane: read all lanes, then write.
  if (lid < CHANNEL_SLOTS) {
    let lane_row = params.lane_offset + t * params.lane_stride;
    let hmix_row = params.hmix_at + t * HMIX;
    var hmix: array<f32, HMIX>;  // hpost_i at i, Hres[i][j] at n + i·n + j
    for (var i = 0u; i < HMIX; i++) {
      hmix[i] = state[hmix_row + i];
    }
    for (var k = 0u; k < PER_THREAD; k++) {
      let q = lid + k * THREADS;
      if (q < CHANNEL_SLOTS) {
        let c = 4u * q;
        let block_out = bx[k] + work[q] * half4_at(params.d4_at + c);
        let y = block_out - state4(params.u_at + t * WIDTH + c);
        var old: array<vec4<f32>, LANES>;
        for (var j = 0u; j < LANES; j++) {
          old[j] = lanes4(lane_row + j * WIDTH + c);
        }
        var mean = vec4<f32>(0.0);
        for (var i = 0u; i < LANES; i++) {
          var mixed = vec4<f32>(0.0);
          for (var j = 0u; j < LANES; j++) {
            mixed += hmix[LANES + i * LANES + j] * old[j];
          }
          let lane = mixed + hmix[i] * y;
          store_lanes4(lane_row + i * WIDTH + c, lane);
          mean += lane;
        }
        if (WRITE_CELL) {
          let cell = params.cell_offset + t * params.cell_stride + c;
          let value = mean / f32(LANES);
          cells[cell] = value.x;
          cells[cell + 1u] = value.y;
          cells[cell + 2u] = value.z;
          cells[cell + 3u] = value.w;
        }
      }
    }
  }
}
