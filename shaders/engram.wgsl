// Engram memory (spec §4.2, §0 items 1 and 4, §6 item 3). Entry points:
//
// `fetch` (one dispatch per site, one workgroup per position t, p = pos0 + t):
//   slot(p, tb) = hash of the raw ids tokens[p - j], j < order(tb) (tokens before 0 read as 0),
//   valid(p, tb) = p >= order(tb) - 1, then
//   e_p = concat_tb(valid ? Tab[tb·slots + slot][0 : sub_dim] : 0)   (rows dequantised, §5.4)
//   eh[site][t] = prepare_input(e_p)   (zero-padded to out_pad, normalised FWHT per GROUP)
//   The key/value projections are the cq_matmul of the [key_proj; value_proj] pack on eh.
// `hashes` (diagnostic, one workgroup per position): slots[t][tb] = slot(p, tb), with bit 31
//   set when the table is not valid yet at p.
// `conv` (workgroups (ceil(d/256), T, sites)): the dilated causal value convolution
//   V[s, p] = Σ_j taps_s[j] ⊙ Vraw[s, p - j·dilation], tap j skipped when j·dilation > p or
//   p < j·max_order. Vraw of positions >= pos0 come from ekv, older ones from the ring
//   [sites][ring_slots][d] (slot = position mod ring_slots); each invocation then stores its
//   own Vraw into the ring. That is race-free when ring_slots >= T + (taps - 1)·dilation (the
//   op asserts it): no slot read by this chunk is written by it.
//
// With PAD_MASK (upstream's hidden cells, §U a): a table is also invalid where its n-gram's
// oldest id tokens[p - order + 1] is 0 (the pad id), and value-conv tap j (tap 0 included) is
// skipped where tokens[p - j·max_order] is 0.
//
// Constants: CODE_BITS, LEVEL_BASE, GROUP, CAP (>= tables·row_pad and >= out_pad, a multiple
// of 256), FWHT_SCALE (f32 of 1/sqrt(GROUP)), MAX_TABLES, ACT_QUANT (deploy numerics: A8 of e_p
// before its transform, §4.9 point 1), PAD_MASK (bool).

struct FetchParams {
  positions: u32,     // T (eh holds [sites][T][out_pad])
  width: u32,         // tables·sub_dim (= d, §0 item 5)
  out_pad: u32,       // pad(width)
  sub_dim: u32,
  row_pad: u32,       // a table row's in_pad (sub_dim padded to the group, §0 item 4)
  row_words: u32,     // u32 words of codes per table row
  groups: u32,        // groups per table row
  norm_base: u32,     // word index of the first FP16 norm pair
  slots: u32,         // rows per table
  heads: u32,         // tables per order (H)
  seed_stride: u32,   // S = seed_heads, or H when seed_heads is 0
  num_orders: u32,
  site: u32,          // output block of eh
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
  orders: vec4<u32>,
}

struct ConvParams {
  d: u32,
  taps: u32,
  dilation: u32,
  max_order: u32,
  ring_slots: u32,
  ekv_stride: u32,     // floats between positions in ekv (sites·2d)
  site_stride: u32,    // floats between sites in an ekv row (2d)
  value_offset: u32,   // float offset of Vraw inside a site's block (d)
  sites: u32,          // ev holds [T][sites][d]
  _pad0: u32,
  _pad1: u32,
  _pad2: u32,
  taps_at: array<vec4<u32>, 4>,  // half offset of each site's taps [taps][d], 4 per vec4
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: FetchParams;
@group(0) @binding(0) var<uniform> conv_params: ConvParams;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read> weights: array<u32>;
@group(0) @binding(4) var<storage, read> levels: array<f32>;
@group(0) @binding(5) var<storage, read_write> eh: array<f32>;
@group(0) @binding(3) var<storage, read_write> slots_out: array<u32>;
@group(0) @binding(2) var<storage, read> fp16: array<u32>;
@group(0) @binding(3) var<storage, read> ekv: array<f32>;
@group(0) @binding(4) var<storage, read_write> ring: array<f32>;
@group(0) @binding(5) var<storage, read_write> ev: array<f32>;
@group(0) @binding(6) var<storage, read> conv_tokens: array<u32>;  // conv reads it with PAD_MASK only

const THREADS: u32 = 256u;
const ITEMS: u32 = CAP / THREADS;
const LEVEL_COUNT: u32 = 1u << CODE_BITS;
const INVALID: u32 = 0xFFFFFFFFu;
const INVALID_BIT: u32 = 0x80000000u;
const SEED_STEP: u32 = 0x9E3779B9u;
const HASH_PRIME: u32 = 0x01000193u;

var<workgroup> fwht_buf: array<f32, CAP>;
var<workgroup> level_table: array<f32, 16>;
var<workgroup> slot_of: array<u32, MAX_TABLES>;

//#include include/fp16.wgsl
//#include include/fwht.wgsl
//#include include/act_quant.wgsl

// Slot of table tb at absolute position p (§4.2); ids before position 0 read as 0.
fn table_slot(p: u32, tb: u32) -> u32 {
  let oi = tb / params.heads;
  var acc = SEED_STEP * (oi * params.seed_stride + tb % params.heads + 1u);
  for (var j = 0u; j < params.orders[oi]; j++) {
    var id = 0u;
    if (j <= p) {
      id = tokens[p - j];
    }
    acc = (acc ^ id) * HASH_PRIME;
  }
  acc ^= acc >> 15u;
  return acc % params.slots;
}

// A table is valid once its n-gram is complete: p >= order - 1 (§4.2).
fn table_valid(p: u32, tb: u32) -> bool {
  let order = params.orders[tb / params.heads];
  if (PAD_MASK && p + 1u >= order && tokens[p + 1u - order] == 0u) {
    return false;  // the n-gram starts at a pad (§U a)
  }
  return p + 1u >= order;
}

//#include include/cq_row.wgsl

@compute @workgroup_size(256)
fn fetch(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let t = wg.x;
  let p = chunk.pos0 + t;
  let tables = params.num_orders * params.heads;
  if (lid < LEVEL_COUNT) {
    level_table[lid] = levels[LEVEL_BASE + lid];
  }
  if (lid < tables) {
    slot_of[lid] = select(INVALID, table_slot(p, lid), table_valid(p, lid));
  }
  workgroupBarrier();

  // Every table row at its padded width: u = level·norm, then the FWHT (§5.4).
  let rows_len = tables * params.row_pad;
  for (var i = lid; i < rows_len; i += THREADS) {
    let tb = i / params.row_pad;
    let m = i % params.row_pad;
    let slot = slot_of[tb];
    var u = 0.0;
    if (slot != INVALID) {
      let row = tb * params.slots + slot;
      u = level_table[code_at(row, m)] * norm_at(row, m / GROUP);
    }
    fwht_buf[i] = u;
  }
  fwht_groups(lid, THREADS, rows_len, GROUP, FWHT_SCALE);

  // Keep the first sub_dim values of each row (a no-op when sub_dim is the group), pad.
  var kept: array<f32, ITEMS>;
  for (var k = 0u; k < ITEMS; k++) {
    let i = lid + k * THREADS;
    var value = 0.0;
    if (i < params.width) {
      value = fwht_buf[(i / params.sub_dim) * params.row_pad + i % params.sub_dim];
    }
    kept[k] = value;
  }
  workgroupBarrier();
  for (var k = 0u; k < ITEMS; k++) {
    let i = lid + k * THREADS;
    if (i < params.out_pad) {
      fwht_buf[i] = kept[k];
    }
  }
  if (ACT_QUANT) {
    act_quant(lid, THREADS, params.width);
  }
  fwht_groups(lid, THREADS, params.out_pad, GROUP, FWHT_SCALE);
  let base = (params.site * params.positions + t) * params.out_pad;
  for (var i = lid; i < params.out_pad; i += THREADS) {
    eh[base + i] = fwht_buf[i];
  }
}

@compute @workgroup_size(64)
fn hashes(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let tables = params.num_orders * params.heads;
  let p = chunk.pos0 + wg.x;
  if (lid < tables) {
    let invalid = select(INVALID_BIT, 0u, table_valid(p, lid));
    slots_out[wg.x * tables + lid] = table_slot(p, lid) | invalid;
  }
}

@compute @workgroup_size(256)
fn conv(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let c = wg.x * THREADS + lid;
  let t = wg.y;
  let site = wg.z;
  let d = conv_params.d;
  if (c >= d) {
    return;
  }
  let p = chunk.pos0 + t;
  let taps_at = conv_params.taps_at[site / 4u][site % 4u];
  let ring_base = site * conv_params.ring_slots * d;
  let column = site * conv_params.site_stride + conv_params.value_offset + c;
  var acc = 0.0;
  for (var j = 0u; j < conv_params.taps; j++) {
    let shift = j * conv_params.dilation;
    if (shift > p || p < j * conv_params.max_order) {
      continue;
    }
    if (PAD_MASK && conv_tokens[p - j * conv_params.max_order] == 0u) {
      continue;  // tap j reads a pad (§U a)
    }
    let q = p - shift;
    var raw: f32;
    if (q >= chunk.pos0) {
      raw = ekv[(q - chunk.pos0) * conv_params.ekv_stride + column];
    } else {
      raw = ring[ring_base + (q % conv_params.ring_slots) * d + c];
    }
    acc += half_at(taps_at + j * d + c) * raw;
  }
  ev[(t * conv_params.sites + site) * d + c] = acc;
  ring[ring_base + (p % conv_params.ring_slots) * d + c] = ekv[t * conv_params.ekv_stride + column];
}
