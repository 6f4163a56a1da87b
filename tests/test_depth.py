"""Elastic depth (spec §10, §U f) on the NumPy reference: the ladder order, the rung's layer
sets for L = 20, and small.cact run at depth 3 against upstream's own rung file and its oracle."""

import numpy as np
import pytest

from needle_wgpu.errors import DepthError, InputError
from needle_wgpu.models.ladder import check_depth, ladder_order, rung
from needle_wgpu.reference.needle3.model import ReferenceModel
from needle_wgpu.synth import GEOMETRIES

from upstream_fixtures import SEQUENCES, logit_error, oracle, upstream_file


def test_ladder_order_is_the_bisection_of_section_10():
    assert ladder_order(20) == (0, 19, 9, 14, 4, 6, 11, 16, 2, 7, 12, 17, 1, 3, 5, 8, 10, 13, 15, 18)
    assert ladder_order(4) == (0, 3, 1, 2)
    for layers in range(1, 40):
        assert sorted(ladder_order(layers)) == list(range(layers))


@pytest.mark.parametrize("depth, blocks, globals_, sites, cells", [
    (2, (0, 19), (1,), (1,), (0, 1, 20)),
    (4, (0, 9, 14, 19), (1, 2, 3), (3,), (0, 1, 10, 15, 20)),
    (7, (0, 4, 6, 9, 11, 14, 19), (1, 3, 5, 6), (4, 6), (0, 1, 5, 7, 10, 12, 15, 20)),
    (10, (0, 2, 4, 6, 7, 9, 11, 14, 16, 19), (2, 5, 7, 9), (4, 6, 9), (0, 1, 3, 5, 7, 8, 10, 12, 15, 17, 20)),
])
def test_rungs_of_twenty_layers_match_the_spec_table(depth, blocks, globals_, sites, cells):
    r = rung(GEOMETRIES["shipped"], depth)  # global 4, 9, 14, 19; sites 3, 7, 11, 15, 19
    assert r.blocks == blocks and r.cells == cells
    assert r.geometry.num_layers == depth
    assert r.geometry.global_layers == globals_ and r.geometry.engram_sites == sites


@pytest.mark.parametrize("bad", [0, 1, -3, 21, 2**70, 3.0, 2.5, "3", None, True, [3]])
def test_depths_the_file_cannot_give_are_a_depth_error(bad):
    with pytest.raises(DepthError):
        check_depth(bad, 20)
    assert issubclass(DepthError, InputError)


def test_depth_of_the_whole_file_and_of_a_one_layer_file():
    assert check_depth(20, 20) == 20 and check_depth(np.int64(5), 20) == 5
    assert check_depth(1, 1) == 1
    assert rung(GEOMETRIES["shipped"], 20).full


def test_small_at_depth_3_is_upstreams_rung_file():
    """The depth-3 rung of small.cact equals small-rung3.cact (upstream's `needle build
    --layers 3`): same geometry, the same logits (exactly) and both match upstream's oracle."""
    at_depth = ReferenceModel(upstream_file("small"), depth=3)
    rung_file = ReferenceModel(upstream_file("small-rung3"))
    assert at_depth.geometry == rung_file.geometry
    z = oracle("small-rung3")
    for seq in SEQUENCES:
        ids = z[f"{seq}.ids"]
        got = at_depth.forward_sequence(ids)
        rel, mismatches = logit_error(got, z[f"{seq}.logits"])
        assert rel <= 1e-4 and mismatches == 0, (seq, rel, mismatches)
        np.testing.assert_array_equal(got, rung_file.forward_sequence(ids))
        assert abs(at_depth.confidence_logit(ids) - float(z[f"{seq}.confidence"])) <= 1e-4, seq


def test_every_rung_of_a_file_runs_and_the_full_depth_is_the_file():
    model = ReferenceModel(upstream_file("small"))
    ids = oracle("small")["len40.ids"]
    full = model.forward_sequence(ids)
    np.testing.assert_array_equal(ReferenceModel(upstream_file("small"), depth=4).forward_sequence(ids), full)
    shallow = ReferenceModel(upstream_file("small"), depth=2).forward_sequence(ids)
    assert shallow.shape == full.shape and np.isfinite(shallow).all() and np.abs(shallow - full).max() > 1e-2
    with pytest.raises(DepthError, match="rungs 2 to 4"):
        ReferenceModel(upstream_file("small"), depth=5)


def test_info_depth_on_the_command_line(capsys):
    import json

    from needle_wgpu import cli

    assert cli.main(["info", str(upstream_file("small")), "--depth", "3"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["depth"] == 3 and info["blocks"] == [0, 1, 3] and info["geometry"]["global_layers"] == []
    assert cli.main(["info", str(upstream_file("small")), "--depth", "7"]) == 2
    assert "rungs 2 to 4" in capsys.readouterr().err
