"""The needle-wgpu command line: synth and info without a GPU, errors as exit codes."""

import json

from needle_wgpu import cli


def test_synth_then_info(tmp_path, capsys):
    out = tmp_path / "tiny.cact"
    assert cli.main(["synth", "--geometry", "tiny", "--seed", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["geometry"]["d_model"] == 256
    assert info["heads"] == [2]
    assert info["records"] == 129 + 1 + 6 + 1  # canon through final_norm, manifest, head, tokenizer
    assert info["tensor_bytes"] < info["file_bytes"]


def test_info_on_a_corrupt_file_is_a_clean_error(tmp_path, capsys):
    bad = tmp_path / "bad.cact"
    bad.write_bytes(b"not a model at all")
    assert cli.main(["info", str(bad)]) == 2
    assert "wrong tag" in capsys.readouterr().err
