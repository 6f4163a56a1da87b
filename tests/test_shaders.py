"""What the WGSL sources themselves must hold (read as text, no GPU)."""

import re

import pytest

from needle_wgpu.gpu.shaders import shader_source

# Kernels whose conditions must not read params: (family, a constant its conditions do test, the
# cost measured on lavapipe when a condition read a uniform).
NO_UNIFORM_BRANCHES = [
    ("mhc_mix", "LANES", "26 ms a dispatch instead of 0.5 ms"),
    ("mlp_mix", "RANK", "56 ms a dispatch instead of 1.1 ms"),
]


@pytest.mark.parametrize("family, constant, cost", NO_UNIFORM_BRANCHES, ids=[f for f, _, _ in NO_UNIFORM_BRANCHES])
def test_never_branches_on_uniforms(family, constant, cost):
    """lavapipe (Mesa 22.3) re-optimises and recompiles a pipeline at every dispatch when a branch
    or loop bound depends on uniform values alone (``cost``). These kernels' sizes and switches
    (the Engram site, the cell write) are pipeline constants, so no condition reads params."""
    found = re.findall(r"\b(?:if|for|while)\s*\((.*)\)\s*\{", shader_source(family))
    assert any(constant in c for c in found)  # the pattern does see the kernel's conditions
    assert [c for c in found if "params." in c] == []
