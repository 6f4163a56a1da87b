"""Shared fixtures: paths to the independent-implementation goldens and synthetic models."""

import os
import stat
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "needle3"  # README.md and SHA256SUMS beside them

# lavapipe prints a harmless warning without a private runtime directory.
if not os.environ.get("XDG_RUNTIME_DIR"):
    runtime = tempfile.mkdtemp(prefix="needle-xdg-")
    os.chmod(runtime, stat.S_IRWXU)
    os.environ["XDG_RUNTIME_DIR"] = runtime


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return FIXTURES
