// The per-submit step uniform (docs/gpu-layout.md): the absolute position of the chunk's first
// token, written by the host before each submit so that prebuilt plans never change.
struct Step {
  pos0: u32,
  _a: u32,
  _b: u32,
  _c: u32,
}
