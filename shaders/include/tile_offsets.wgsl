// The row-per-invocation matmuls' position offsets (q_matmul_rows.wgsl, cq_matmul_rows.wgsl):
// ``pJ`` is position J of a tile of ``tile`` positions ``stride`` words apart; a position past
// the tile reads position 0 of the tile (always valid), and its sum is never stored.

struct TileOffsets { p1: u32, p2: u32, p3: u32, p4: u32, p5: u32, p6: u32, p7: u32 }

fn tile_offsets(stride: u32, tile: u32) -> TileOffsets {
  return TileOffsets(select(0u, stride, tile > 1u), select(0u, 2u * stride, tile > 2u),
                     select(0u, 3u * stride, tile > 3u), select(0u, 4u * stride, tile > 4u),
                     select(0u, 5u * stride, tile > 5u), select(0u, 6u * stride, tile > 6u),
                     select(0u, 7u * stride, tile > 7u));
}
