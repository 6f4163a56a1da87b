"""GPU tests share one device per session (lavapipe in CI)."""

import pytest


@pytest.fixture(scope="session")
def device():
    from needle_wgpu.errors import DeviceError
    from needle_wgpu.gpu import open_device

    try:
        return open_device()
    except DeviceError as exc:
        pytest.fail(f"no WebGPU adapter: {exc} (install mesa-vulkan-drivers)")
