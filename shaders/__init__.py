"""WGSL sources of needle-wgpu: one file per kernel family (shipped inside the wheel)."""
