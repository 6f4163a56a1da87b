// Reading one CQ row from a pack buffer bound as `weights: array<u32>` (§5.1, §5.2).
// Included by kernels whose Params have row_words, groups and norm_base and that define
// CODE_BITS and LEVEL_COUNT.

// Code k of slice row `row`: an LSB-first bitstream read as u32 words (§5.2).
fn code_at(row: u32, k: u32) -> u32 {
  let bit = k * CODE_BITS;
  let at = row * params.row_words + (bit >> 5u);
  let shift = bit & 31u;
  var field = weights[at] >> shift;
  if (shift + CODE_BITS > 32u) {
    field |= weights[at + 1u] << (32u - shift);
  }
  return field & (LEVEL_COUNT - 1u);
}

fn norm_at(row: u32, group: u32) -> f32 {
  let index = row * params.groups + group;
  let pair = unpack2x16float(weights[params.norm_base + (index >> 1u)]);
  return select(pair.x, pair.y, (index & 1u) == 1u);
}
