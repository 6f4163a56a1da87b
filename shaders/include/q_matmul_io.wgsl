// The parameters and bindings of both q_matmul skeletons (q_matmul.wgsl, q_matmul_rows.wgsl).

struct Params {
  rows: u32,        // rows computed by this dispatch
  row0: u32,        // first row, counted in the bound part
  side_base: u32,   // word index of the side plane in the part
  positions: u32,
  x_stride: u32,    // floats between positions in x (multiple of 4)
  x_offset: u32,    // float offset of position 0 in x (multiple of 4)
  y_stride: u32,
  y_offset: u32,    // float offset of row 0, position 0 in y
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> weights: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn word(i: u32) -> u32 {
  return weights[i];
}

