"""The reference fixtures from independent implementations are in the repository, unchanged:
every file each folder's SHA256SUMS names is there with that digest, and nothing else is."""

import hashlib
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("folder", ["needle3", "upstream"])
def test_fixture_folder_matches_its_checksums(folder):
    root = FIXTURES / folder
    listed = {}
    for line in (root / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name.lstrip("*")] = digest
    present = {p.name for p in root.iterdir()} - {"SHA256SUMS", "README.md"}
    assert present == set(listed), "files and SHA256SUMS disagree"
    for name, digest in listed.items():
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest, name
