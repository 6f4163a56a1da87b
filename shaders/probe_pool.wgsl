// Confidence probe pool (spec §7 step 1, the streaming ProbePool), one workgroup per
// (cell l, probe kk), its invocations splitting the d columns:
//
//   for each position t of the chunk, with x = scores[t][l·k + kk] / sqrt(d):
//     m' = max(m, x);  s = s·exp(m − m') + exp(x − m');  a = a·exp(m − m') + exp(x − m')·cell[t][l]
//
// A position whose token is the pad id 0 is skipped (its score is −inf upstream, §U a).
// Every invocation recomputes the scalar recurrence for itself, so no barriers are needed; the
// state (m, s, a[d]) persists across chunks in `pool` ([C·k][d + 2]: a, then m, then s).
// The scores are the band products probe_{l,kk} · cell_{t,l} from cq_matmul.

//#include include/step.wgsl

struct Params {
  d: u32,
  positions: u32,
  probes: u32,        // C·k
  per_cell: u32,      // k
  cell_stride: u32,   // floats between positions in cells (C·d)
  inv_sqrt_d: f32,
  _pad0: u32,
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> scores: array<f32>;
@group(0) @binding(2) var<storage, read> cells: array<f32>;
@group(0) @binding(3) var<storage, read_write> pool: array<f32>;
@group(0) @binding(4) var<uniform> chunk: Step;
@group(0) @binding(5) var<storage, read> tokens: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let probe = wg.x;
  let cell = probe / params.per_cell;
  let base = probe * (params.d + 2u);
  var m = pool[base + params.d];
  var s = pool[base + params.d + 1u];
  for (var t = 0u; t < params.positions; t++) {
    if (tokens[chunk.pos0 + t] == 0u) {
      continue;
    }
    let x = scores[t * params.probes + probe] * params.inv_sqrt_d;
    let m_new = max(m, x);
    let rescale = exp(m - m_new);  // exp(-inf) = 0 on the first position
    let weight = exp(x - m_new);
    for (var c = lid; c < params.d; c += 64u) {
      let at = base + c;
      pool[at] = pool[at] * rescale + weight * cells[t * params.cell_stride + cell * params.d + c];
    }
    s = s * rescale + weight;
    m = m_new;
  }
  workgroupBarrier();
  if (lid == 0u) {
    pool[base + params.d] = m;
    pool[base + params.d + 1u] = s;
  }
}
