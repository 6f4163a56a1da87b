// The block tail (spec §4.5 items 10-13, §4.6, §4.7, §4.8), one workgroup per position t:
//
//   bx += σ(attn_gate) · ZCRMSNorm(a; post_norm)          a = the out_proj product
//   x   = ZCRMSNorm(bx; pre_hada)
//   bx += HadaMLP(x)                                        (§4.6, three Kronecker stages)
//   y   = bx − u
//   X'[i] = Σ_j Hres[i, j]·X[j] + hpost_i·y                 (scatter_up, in place in lanes)
//   cells[t][cell] = (1/n)·Σ_j X'[j]                        (when write_cell is 1)
//
// Kron(z; A, B) views z as Z [ba][bb] row-major and returns flatten(Aᵀ·Z·B): Aᵀ·Z goes into the
// other half of `work`, then ·B comes back. The two halves of `work` hold the current vector
// and the scratch, so the gathers by p1 / p2 read one half and write the other.
// Constants: N_CAP (>= hada_n), F_CAP (>= max(ba², bb²), also >= the cond rank). n <= MAX_LANES.

struct Params {
  lanes: u32,         // n
  width: u32,         // d
  hada_n: u32,        // N = ba · bb
  rank: u32,          // r, from the cond_v shape (§0 item 3)
  ba: u32,
  bb: u32,
  lane_stride: u32,   // floats between positions in lanes
  lane_offset: u32,
  a_stride: u32,      // floats between positions in a
  a_offset: u32,
  u_at: u32,          // state: u [T][d], bx [T][d], hmix [T][n + n·n] (written by mhc_mix)
  bx_at: u32,
  hmix_at: u32,
  cell_stride: u32,   // floats between positions in cells
  cell_offset: u32,   // float offset of this layer's cell at position 0
  write_cell: u32,    // 1: write the lane mean into cells
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
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> attn: array<f32>;
@group(0) @binding(2) var<storage, read> state: array<f32>;
@group(0) @binding(3) var<storage, read_write> lanes: array<f32>;
@group(0) @binding(4) var<storage, read> fp16: array<u32>;
@group(0) @binding(5) var<storage, read> perm: array<u32>;
@group(0) @binding(6) var<storage, read_write> cells: array<f32>;

const THREADS: u32 = 256u;
const PER_THREAD: u32 = (N_CAP + THREADS - 1u) / THREADS;
const MAX_LANES: u32 = 16u;
const EPS: f32 = 1e-6;
const SLICE: u32 = 32u;             // invocations per cond logit
const SLICES: u32 = THREADS / SLICE;

var<workgroup> work: array<f32, 2u * N_CAP>;
var<workgroup> factor: array<f32, F_CAP>;
var<workgroup> partial: array<f32, THREADS>;

//#include fp16.wgsl

fn sigmoid(x: f32) -> f32 {
  return 1.0 / (1.0 + exp(-x));
}

// Sum (or max) of one value per invocation in tree order; every invocation gets the result.
fn workgroup_reduce(lid: u32, value: f32, take_max: bool) -> f32 {
  partial[lid] = value;
  workgroupBarrier();
  for (var step = THREADS / 2u; step > 0u; step >>= 1u) {
    if (lid < step) {
      let other = partial[lid + step];
      partial[lid] = select(partial[lid] + other, max(partial[lid], other), take_max);
    }
    workgroupBarrier();
  }
  let total = workgroupUniformLoad(&partial[0]);
  workgroupBarrier();  // partial is reused by the next reduction
  return total;
}

// work[src .. src+N) <- Kron(work[src ..]; A, B) using work[tmp .. tmp+N) as scratch (§4.6).
fn kron(lid: u32, src: u32, tmp: u32, a_at: u32, b_at: u32) {
  let ba = params.ba;
  let bb = params.bb;
  let count = params.hada_n;
  workgroupBarrier();
  for (var i = lid; i < ba * ba; i += THREADS) {
    factor[i] = half_at(a_at + i);
  }
  workgroupBarrier();
  // T = Aᵀ·Z: T[k][j] = Σ_i A[i][k]·Z[i][j], i ascending.
  for (var o = lid; o < count; o += THREADS) {
    let k = o / bb;
    let j = o % bb;
    var acc = 0.0;
    for (var i = 0u; i < ba; i++) {
      acc += factor[i * ba + k] * work[src + i * bb + j];
    }
    work[tmp + o] = acc;
  }
  workgroupBarrier();
  for (var i = lid; i < bb * bb; i += THREADS) {
    factor[i] = half_at(b_at + i);
  }
  workgroupBarrier();
  // out = T·B: out[k][l] = Σ_j T[k][j]·B[j][l], j ascending.
  for (var o = lid; o < count; o += THREADS) {
    let k = o / bb;
    let l = o % bb;
    var acc = 0.0;
    for (var j = 0u; j < bb; j++) {
      acc += work[tmp + k * bb + j] * factor[j * bb + l];
    }
    work[src + o] = acc;
  }
  workgroupBarrier();
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let t = wg.x;
  let d = params.width;
  let count = params.hada_n;
  let rank = params.rank;
  // Invocation lid owns channels (and hada elements) lid + THREADS·k.

  // Items 10-11: bx += σ(attn_gate) · ZCRMSNorm(a; post_norm).
  var a: array<f32, PER_THREAD>;
  var bx: array<f32, PER_THREAD>;
  var squares = 0.0;
  for (var k = 0u; k < PER_THREAD; k++) {
    let c = lid + k * THREADS;
    a[k] = 0.0;
    if (c < d) {
      a[k] = attn[params.a_offset + t * params.a_stride + c];
      squares += a[k] * a[k];
    }
  }
  let inv_a = 1.0 / sqrt(workgroup_reduce(lid, squares, false) / f32(d) + EPS);
  let gate = sigmoid(half_at(params.attn_gate_at));
  squares = 0.0;
  for (var k = 0u; k < PER_THREAD; k++) {
    let c = lid + k * THREADS;
    bx[k] = 0.0;
    if (c < d) {
      let normed = (1.0 + half_at(params.post_norm_at + c)) * a[k] * inv_a;
      bx[k] = state[params.bx_at + t * d + c] + gate * normed;
      squares += bx[k] * bx[k];
    }
  }

  // Item 12 input: x = ZCRMSNorm(bx; pre_hada) into work[N ..]; z = pad(x) ⊙ d1 into work[0 ..].
  let inv_b = 1.0 / sqrt(workgroup_reduce(lid, squares, false) / f32(d) + EPS);
  for (var k = 0u; k < PER_THREAD; k++) {
    let i = lid + k * THREADS;
    if (i < count) {
      var x = 0.0;
      if (i < d) {
        x = (1.0 + half_at(params.pre_hada_at + i)) * bx[k] * inv_b;
      }
      work[count + i] = x;
      work[i] = x * half_at(params.d1_at + i);
    }
  }
  workgroupBarrier();

  // §4.6 step 1: logits x·cond_v (SLICE invocations per logit), softmax, cond = 1 + c·cond_u.
  let slice = lid / SLICE;
  let member = lid % SLICE;
  for (var base = 0u; base < rank; base += SLICES) {
    let j = base + slice;
    var acc = 0.0;
    if (j < rank) {
      for (var c = member; c < d; c += SLICE) {
        acc += work[count + c] * half_at(params.cond_v_at + c * rank + j);
      }
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var step = SLICE / 2u; step > 0u; step >>= 1u) {
      if (member < step) {
        partial[lid] += partial[lid + step];
      }
      workgroupBarrier();
    }
    if (member == 0u && j < rank) {
      factor[j] = partial[lid];
    }
    workgroupBarrier();
  }
  var top = -3.4e38;
  for (var j = lid; j < rank; j += THREADS) {
    top = max(top, factor[j]);
  }
  top = workgroup_reduce(lid, top, true);
  var total = 0.0;
  for (var j = lid; j < rank; j += THREADS) {
    let e = exp(factor[j] - top);
    factor[j] = e;
    total += e;
  }
  total = workgroup_reduce(lid, total, false);
  var cond: array<f32, PER_THREAD>;
  for (var k = 0u; k < PER_THREAD; k++) {
    let i = lid + k * THREADS;
    cond[k] = 0.0;
    if (i < count) {
      var acc = 0.0;
      for (var j = 0u; j < rank; j++) {
        acc += (factor[j] / total) * half_at(params.cond_u_at + j * count + i);
      }
      cond[k] = 1.0 + acc;
    }
  }

  // Steps 3-4: Kron 1, gather by p1, silu((d2·cond)·z + b2) into work[N ..].
  kron(lid, 0u, count, params.w1a_at, params.w1b_at);
  for (var k = 0u; k < PER_THREAD; k++) {
    let i = lid + k * THREADS;
    if (i < count) {
      let z = work[perm[params.p1_at + i]];
      let pre = (half_at(params.d2_at + i) * cond[k]) * z + half_at(params.b2_at + i);
      work[count + i] = pre * sigmoid(pre);
    }
  }
  // Steps 5-6: Kron 2, gather by p2, ⊙ d3 into work[0 ..], Kron 3.
  kron(lid, count, 0u, params.w2a_at, params.w2b_at);
  for (var k = 0u; k < PER_THREAD; k++) {
    let i = lid + k * THREADS;
    if (i < count) {
      work[i] = work[count + perm[params.p2_at + i]] * half_at(params.d3_at + i);
    }
  }
  kron(lid, 0u, count, params.w3a_at, params.w3b_at);

  // Step 7 and items 12-13: bx += (z ⊙ d4)[0:d]; y = bx − u; then scatter_up (§4.7) and the
  // cell (§4.8). Each invocation owns its channels in every lane: read all lanes, then write.
  let n = params.lanes;
  let lane_row = params.lane_offset + t * params.lane_stride;
  let hmix_row = params.hmix_at + t * (n + n * n);
  for (var k = 0u; k < PER_THREAD; k++) {
    let c = lid + k * THREADS;
    if (c < d) {
      let block_out = bx[k] + work[c] * half_at(params.d4_at + c);
      let y = block_out - state[params.u_at + t * d + c];
      var old: array<f32, MAX_LANES>;
      for (var j = 0u; j < n; j++) {
        old[j] = lanes[lane_row + j * d + c];
      }
      var mean = 0.0;
      for (var i = 0u; i < n; i++) {
        var mixed = 0.0;
        for (var j = 0u; j < n; j++) {
          mixed += state[hmix_row + n + i * n + j] * old[j];
        }
        let lane = mixed + state[hmix_row + i] * y;
        lanes[lane_row + i * d + c] = lane;
        mean += lane;
      }
      if (params.write_cell != 0u) {
        cells[params.cell_offset + t * params.cell_stride + c] = mean / f32(n);
      }
    }
  }
}
