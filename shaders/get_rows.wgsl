// GGUF row gather, the embedding lookup (dense-gguf spec §3 step 1, §4.4):
//
//   out[out_offset + t * out_stride + i] = scale * W[min(tokens[pos0 + t], total_rows - 1), i]
//
// The clamp is for this lookup only (an out-of-range id reads the last row, never outside the
// pack). A pack split along rows is gathered with one dispatch per part; an invocation whose
// row another part holds does nothing. No barriers: one shape for CPU adapters and GPUs.
//
// Constants: QTYPE, BLOCK_WORDS, BLOCK_QUADS, SUB_QUADS, ROW_BLOCKS.
// Bindings: 0 params, 1 step (pos0), 2 tokens u32 by absolute position, 3 one part of the
// pack, 4 out f32. Workgroups: (ceil(cols / 4 / 64), positions), one quad per invocation.

struct Params {
  part_first: u32,  // first pack row held by the bound part
  part_rows: u32,
  total_rows: u32,  // rows of the whole pack
  side_base: u32,   // word index of the side plane in the part
  out_stride: u32,  // floats between positions in out (multiple of 4)
  out_offset: u32,  // multiple of 4
  scale: f32,
  _pad0: u32,
}

//#include include/step.wgsl

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> chunk: Step;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read> weights: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;

fn word(i: u32) -> u32 {
  return weights[i];
}

//#include include/gguf_blocks.wgsl

const ROW_QUADS: u32 = ROW_BLOCKS * BLOCK_QUADS;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let q = gid.x;
  let t = gid.y;
  if (q >= ROW_QUADS) {
    return;
  }
  let id = min(tokens[chunk.pos0 + t], params.total_rows - 1u);
  if (id < params.part_first || id - params.part_first >= params.part_rows) {
    return;
  }
  let row = id - params.part_first;
  let w = quad(row * ROW_BLOCKS + q / BLOCK_QUADS, q % BLOCK_QUADS);
  out[((params.out_offset + t * params.out_stride) >> 2u) + q] = w * params.scale;
}
