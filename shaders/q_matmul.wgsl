// GGUF dequant-matmul, GPU shape (dense-gguf spec §8), after ggml-webgpu's mul_mat_vec and
// mul_mat_reg_tile:
//
//   y[y_offset + t * y_stride + o] (+)= sum_i W[row0 + o, i] * x[x_offset + t * x_stride + i]
//
// Entry `gemv` (decode): 256 threads and 4 rows per workgroup, one position per workgroup row
// of the grid. Threads stride over the quads of a row; each activation quad is loaded once into
// registers and used for the 4 rows; a workgroup-memory tree sums the 256 partials (portable: no
// subgroups, which Naga rejects).
// Entry `gemv_batch` (a batch of decode steps, one position per sequence): `gemv` over up to
// BATCH (4) positions per workgroup, each weight quad decoded once for all of them; each
// position's partials are summed exactly as `gemv` sums its one position (the same strided
// products in the same order, the same tree), so a sequence's row has the same bits in a batch
// as alone.
// Entry `gemm` (prefill): 8 x 8 threads, each 4 rows x 4 positions of a 32 x 32 output tile.
// Per K step of 32 weights (one 32-block, or a 32-weight slice of a K-quant block) the 32 x 32
// weight tile is dequantised once into workgroup memory with the 32 x 32 activation tile; f32
// accumulation throughout (ggml accumulates in f16, a parity risk for §7).
//
// Constants: QTYPE, BLOCK_WORDS, BLOCK_QUADS, SUB_QUADS, ROW_BLOCKS (GPU blocks per row), ACCUMULATE.
// Bindings: 0 params, 1 one part of the pack (word plane, then side plane), 2 x f32, 3 y f32.
// Workgroups (rows folded as x + z * num_workgroups.x): gemv (ceil(rows / 4), positions),
// gemv_batch (ceil(rows / 4), ceil(positions / 4)), gemm (ceil(rows / 32), ceil(positions / 32)).

//#include include/q_matmul_io.wgsl
//#include include/gguf_blocks.wgsl

const ROW_QUADS: u32 = ROW_BLOCKS * BLOCK_QUADS;

fn store(index: u32, value: f32) {
  if (ACCUMULATE) {
    y[index] += value;
  } else {
    y[index] = value;
  }
}

// Quad q of pack-part row `row` (q < ROW_QUADS).
fn row_quad(row: u32, q: u32) -> vec4<f32> {
  return quad(row * ROW_BLOCKS + q / BLOCK_QUADS, q % BLOCK_QUADS);
}

// ---- gemv ----------------------------------------------------------------------------------

const GEMV_THREADS: u32 = 256u;
const GEMV_ROWS: u32 = 4u;

var<workgroup> partial: array<vec4<f32>, GEMV_THREADS>;

// The 4 pack-part rows of the workgroup whose first row is `first`: rows past the end
// recompute the last row (always valid) and are not stored.
fn gemv_rows(first: u32) -> vec4<u32> {
  return vec4<u32>(params.row0) + min(vec4<u32>(first) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(params.rows - 1u));
}

// The 256 partials of position t summed by a workgroup-memory tree, then stored.
fn reduce_store(lid: u32, acc: vec4<f32>, first: u32, t: u32) {
  partial[lid] = acc;
  workgroupBarrier();
  for (var span = GEMV_THREADS / 2u; span > 0u; span >>= 1u) {
    if (lid < span) {
      partial[lid] += partial[lid + span];
    }
    workgroupBarrier();
  }
  if (lid < GEMV_ROWS && first + lid < params.rows && t < params.positions) {
    store(params.y_offset + t * params.y_stride + first + lid, partial[0][lid]);
  }
  workgroupBarrier();  // partial[0] is read before a next position overwrites it
}

@compute @workgroup_size(256)
fn gemv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let first = (wg.x + wg.z * groups.x) * GEMV_ROWS;
  if (first >= params.rows) {
    return;  // the whole workgroup: a surplus group of the fold
  }
  let r = gemv_rows(first);
  let t = wg.y;
  let x_base = (params.x_offset + t * params.x_stride) >> 2u;
  var acc = vec4<f32>(0.0);  // one component per row
  for (var q = lid; q < ROW_QUADS; q += GEMV_THREADS) {
    let xv = x[x_base + q];
    acc += vec4<f32>(dot(row_quad(r.x, q), xv), dot(row_quad(r.y, q), xv), dot(row_quad(r.z, q), xv),
                     dot(row_quad(r.w, q), xv));
  }
  reduce_store(lid, acc, first, t);
}

// ---- gemv_batch ----------------------------------------------------------------------------

const BATCH: u32 = 4u;  // positions per workgroup

@compute @workgroup_size(256)
fn gemv_batch(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
  let first = (wg.x + wg.z * groups.x) * GEMV_ROWS;
  if (first >= params.rows) {
    return;  // the whole workgroup: a surplus group of the fold
  }
  let r = gemv_rows(first);
  let t0 = wg.y * BATCH;
  // Positions past the end recompute the last position (always valid) and are not stored.
  let last_t = params.positions - 1u;
  let x0 = (params.x_offset + t0 * params.x_stride) >> 2u;
  let x1 = (params.x_offset + min(t0 + 1u, last_t) * params.x_stride) >> 2u;
  let x2 = (params.x_offset + min(t0 + 2u, last_t) * params.x_stride) >> 2u;
  let x3 = (params.x_offset + min(t0 + 3u, last_t) * params.x_stride) >> 2u;
  var a0 = vec4<f32>(0.0);  // position t0 + p: one component per row
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  for (var q = lid; q < ROW_QUADS; q += GEMV_THREADS) {
    let w0 = row_quad(r.x, q);
    let w1 = row_quad(r.y, q);
    let w2 = row_quad(r.z, q);
    let w3 = row_quad(r.w, q);
    let v0 = x[x0 + q];
    a0 += vec4<f32>(dot(w0, v0), dot(w1, v0), dot(w2, v0), dot(w3, v0));
    let v1 = x[x1 + q];
    a1 += vec4<f32>(dot(w0, v1), dot(w1, v1), dot(w2, v1), dot(w3, v1));
    let v2 = x[x2 + q];
    a2 += vec4<f32>(dot(w0, v2), dot(w1, v2), dot(w2, v2), dot(w3, v2));
    let v3 = x[x3 + q];
    a3 += vec4<f32>(dot(w0, v3), dot(w1, v3), dot(w2, v3), dot(w3, v3));
  }
  reduce_store(lid, a0, first, t0);
  reduce_store(lid, a1, first, t0 + 1u);
  reduce_store(lid, a2, first, t0 + 2u);
  reduce_store(lid, a3, first, t0 + 3u);
}

// ---- gemm ----------------------------------------------------------------------------------

const TILE: u32 = 32u;        // rows and positions per workgroup
const K_QUADS: u32 = 8u;      // quads per K step (32 weights)
const PITCH: u32 = K_QUADS + 1u;  // tile row pitch in quads: the padding spreads a column's reads over banks

var<workgroup> w_tile: array<vec4<f32>, TILE * PITCH>;  // [row][quad]
var<workgroup> x_tile: array<vec4<f32>, TILE * PITCH>;  // [position][quad]

@compute @workgroup_size(64)
fn gemm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let row_tile = (wg.x + wg.z * groups.x) * TILE;
  if (row_tile >= params.rows) {
    return;  // the whole workgroup: a surplus group of the fold
  }
  let t_tile = wg.y * TILE;
  // Thread (tr, tt) owns rows tr + 8i and positions tt + 8p, i, p < 4.
  let tr = lid % 8u;
  let tt = lid / 8u;
  var acc: array<vec4<f32>, 4>;  // acc[i][p]
  for (var k0 = 0u; k0 < ROW_QUADS; k0 += K_QUADS) {
    for (var n = 0u; n < 4u; n++) {
      let e = lid + 64u * n;
      let r = e / K_QUADS;
      let kq = e % K_QUADS;
      let q = k0 + kq;
      var wv = vec4<f32>(0.0);
      if (row_tile + r < params.rows && q < ROW_QUADS) {
        wv = row_quad(params.row0 + row_tile + r, q);
      }
      w_tile[r * PITCH + kq] = wv;
      var xv = vec4<f32>(0.0);
      if (t_tile + r < params.positions && q < ROW_QUADS) {
        xv = x[((params.x_offset + (t_tile + r) * params.x_stride) >> 2u) + q];
      }
      x_tile[r * PITCH + kq] = xv;
    }
    workgroupBarrier();
    for (var kq = 0u; kq < K_QUADS; kq++) {
      let x0 = x_tile[tt * PITCH + kq];
      let x1 = x_tile[(tt + 8u) * PITCH + kq];
      let x2 = x_tile[(tt + 16u) * PITCH + kq];
      let x3 = x_tile[(tt + 24u) * PITCH + kq];
      for (var i = 0u; i < 4u; i++) {
        let w = w_tile[(tr + 8u * i) * PITCH + kq];
        acc[i] += vec4<f32>(dot(w, x0), dot(w, x1), dot(w, x2), dot(w, x3));
      }
    }
    workgroupBarrier();
  }
  for (var i = 0u; i < 4u; i++) {
    let o = row_tile + tr + 8u * i;
    for (var p = 0u; p < 4u; p++) {
      let t = t_tile + tt + 8u * p;
      if (o < params.rows && t < params.positions) {
        store(params.y_offset + t * params.y_stride + o, acc[i][p]);
      }
    }
  }
}
