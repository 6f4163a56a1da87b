// Embedding lookup (spec §4.1, §4.3, §4.8 cells, §0 item 1), one workgroup per position t:
//
//   id      = min(tokens[pos0 + t], vocab - 1)          (the clamp is for this lookup only)
//   u_m     = level[code(id, gG + m)] · norm[id, g]      per group g (§5.4)
//   x0      = (normalised FWHT of u per group)[0 : d] · sqrt(d)
//   lanes[t][j] = x0 for every lane j; entry `with_cells` also writes cells[t][0] = x0.
//
// The embedding pack may be split along rows into several buffers (kernels/cq.py): the op
// dispatches once per slice and a workgroup whose row lives in another slice does nothing.
//
// Constants: CODE_BITS, LEVEL_BASE (the width's table in `levels`), GROUP, CAP (>= row_pad),
// FWHT_SCALE (f32 of 1/sqrt(GROUP)).

struct Params {
  d: u32,             // d_model (the row is truncated to d columns)
  lanes: u32,         // n
  vocab: u32,
  row_pad: u32,       // in_pad of the embedding (multiple of GROUP)
  row_words: u32,     // u32 words of codes per row
  groups: u32,        // groups per row
  norm_base: u32,     // word index of the first FP16 norm pair in this slice
  slice_first: u32,   // first vocabulary row held by this slice
  slice_rows: u32,
  cells_stride: u32,  // floats between positions in cells ((L + 1)·d)
  scale: f32,         // f32 of sqrt(d) (§4.1)
  _pad0: u32,
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read> weights: array<u32>;
@group(0) @binding(4) var<storage, read> levels: array<f32>;
@group(0) @binding(5) var<storage, read_write> lanes: array<f32>;
@group(0) @binding(6) var<storage, read_write> cells: array<f32>;

const THREADS: u32 = 256u;
const LEVEL_COUNT: u32 = 1u << CODE_BITS;

var<workgroup> fwht_buf: array<f32, CAP>;
var<workgroup> level_table: array<f32, 16>;
var<workgroup> row_id: u32;

//#include include/fwht.wgsl

//#include include/cq_row.wgsl

// Dequantises the clamped row of position t into fwht_buf; false (for the whole workgroup)
// when another slice holds that row.
fn load_row(lid: u32, t: u32) -> bool {
  if (lid == 0u) {
    row_id = min(tokens[chunk.pos0 + t], params.vocab - 1u);
  }
  if (lid < LEVEL_COUNT) {
    level_table[lid] = levels[LEVEL_BASE + lid];
  }
  let id = workgroupUniformLoad(&row_id);
  if (id < params.slice_first || id - params.slice_first >= params.slice_rows) {
    return false;
  }
  let row = id - params.slice_first;
  for (var k = lid; k < params.row_pad; k += THREADS) {
    fwht_buf[k] = level_table[code_at(row, k)] * norm_at(row, k / GROUP);
  }
  fwht_groups(lid, THREADS, params.row_pad, GROUP, FWHT_SCALE);
  return true;
}

fn write_lanes(lid: u32, t: u32) {
  for (var c = lid; c < params.d; c += THREADS) {
    let x0 = fwht_buf[c] * params.scale;
    for (var j = 0u; j < params.lanes; j++) {
      lanes[(t * params.lanes + j) * params.d + c] = x0;
    }
  }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  if (!load_row(lid, wg.x)) {
    return;
  }
  write_lanes(lid, wg.x);
}

@compute @workgroup_size(256)
fn with_cells(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  if (!load_row(lid, wg.x)) {
    return;
  }
  write_lanes(lid, wg.x);
  for (var c = lid; c < params.d; c += THREADS) {
    cells[wg.x * params.cells_stride + c] = fwht_buf[c] * params.scale;
  }
}
