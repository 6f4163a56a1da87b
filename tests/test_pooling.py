"""``needle_wgpu.pooling`` (dense embeddings) against NumPy: mean, cls and last over rows, the
L2 normalisation, and the file's pooling_type read as llama.cpp numbers it."""

from types import SimpleNamespace

import numpy as np
import pytest

from needle_wgpu.pooling import Pool, file_pooling, rows_needed


def pooled(pooling, rows):
    pool = Pool(pooling, rows.shape[1])
    for r in rows_needed(pooling, len(rows)):
        pool.add(rows[r].tolist())
    return np.array(pool.vector())


@pytest.mark.parametrize("positions", [1, 2, 7])
def test_pooling_matches_numpy(positions):
    rows = np.random.default_rng(positions).standard_normal((positions, 24))
    want = {"mean": rows.mean(0), "cls": rows[0], "last": rows[-1]}
    for pooling, vector in want.items():
        np.testing.assert_allclose(pooled(pooling, rows), vector / np.linalg.norm(vector), rtol=0, atol=1e-12)


def test_a_zero_row_stays_zero_and_an_empty_pool_is_zero():
    assert pooled("mean", np.zeros((3, 4))).tolist() == [0.0] * 4
    assert Pool("last", 4).vector() == [0.0] * 4


def test_rows_needed_reads_only_what_the_pooling_uses():
    assert list(rows_needed("mean", 5)) == [0, 1, 2, 3, 4]
    assert list(rows_needed("cls", 5)) == [0] and list(rows_needed("last", 5)) == [4]
    assert list(rows_needed("last", 0)) == [] and list(rows_needed("cls", 0)) == []


def test_file_pooling_follows_llamacpp_numbering():
    def file(value):
        def get_int(key, default):
            assert key == "llama.pooling_type"
            if isinstance(value, Exception):
                raise value
            return default if value is None else value
        return SimpleNamespace(get_int=get_int)

    assert [file_pooling(file(v), "llama") for v in (None, 0, 1, 2, 3, 4, 99)] == \
        ["mean", "mean", "mean", "cls", "last", "", ""]
    assert file_pooling(file(ValueError("a string")), "llama") == "mean"
    with pytest.raises(ValueError):
        Pool("rank", 4)
