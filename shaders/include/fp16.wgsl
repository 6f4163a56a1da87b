// FP16 parameters read from the shared `fp16` buffer of u32 words (two halves per word), so no
// shader-f16 support is needed. Included by kernels that bind `fp16: array<u32>`.
fn half_at(index: u32) -> f32 {
  let pair = unpack2x16float(fp16[index >> 1u]);
  return select(pair.x, pair.y, (index & 1u) == 1u);
}

// The four halves at an even half offset: two words, no per-element select.
fn half4_at(index: u32) -> vec4<f32> {
  let word = index >> 1u;
  return vec4<f32>(unpack2x16float(fp16[word]), unpack2x16float(fp16[word + 1u]));
}
