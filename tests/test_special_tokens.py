"""The special-token splitter (formats/special_tokens.py) against a plain transcription of
llama.cpp's ``tokenizer_st_partition``, on random texts over small alphabets where special
tokens overlap, nest and run."""

import random

import pytest

from needle_wgpu.formats.special_tokens import SpecialTokenSplitter


def llama_cpp_partition(text: str, specials) -> list:
    """llama.cpp's loop as written: for each special token in order, for each text fragment,
    cut out occurrences leftmost first and continue to the right of each."""
    fragments = [text] if text else []
    for token, token_id in specials:
        out = []
        for fragment in fragments:
            if not isinstance(fragment, str):
                out.append(fragment)
                continue
            while True:
                at = fragment.find(token)
                if at < 0:
                    if fragment:
                        out.append(fragment)
                    break
                if at > 0:
                    out.append(fragment[:at])
                out.append(token_id)
                fragment = fragment[at + len(token):]
        fragments = out
    return fragments


def ordered(texts):
    """(text, id) in llama.cpp's order: longest first, ties by id."""
    pairs = [(t, i) for i, t in enumerate(texts)]
    return sorted(pairs, key=lambda p: (-len(p[0]), p[1]))


CASES = {
    "overlapping": ["XY", "YZZ", "ZZ", "Z", "XYZ", "YX"],
    "runs": [" " * k for k in range(2, 9)] + ["\n" * k for k in range(1, 6)] + ["\t"],
    "runs and tags": [" " * k for k in range(2, 6)] + ["<a>", "<a", "a>", "<", "\n\n"],
    "mixed runs": ["  ", "   ", " a", "aa", "a"],  # ' ' also occurs in " a": no run shortcut
}
ALPHABETS = {"overlapping": "XYZ a", "runs": " \n\tab", "runs and tags": " \n<a>b",
             "mixed runs": " ab"}


@pytest.mark.parametrize("case", list(CASES))
def test_splitter_matches_llama_cpp_loop(case):
    specials = ordered(CASES[case])
    splitter = SpecialTokenSplitter(specials)
    rng = random.Random(case)
    alphabet = ALPHABETS[case]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert splitter.split(text) == llama_cpp_partition(text, specials), repr(text)


def test_run_shortcut_is_taken_and_exact():
    runs = ordered([" " * k for k in range(2, 32)] + ["\n" * k for k in range(1, 32)])
    splitter = SpecialTokenSplitter(runs)
    assert set(splitter._runs) == {" ", "\n"} and splitter._starts is None
    text = "x" + " " * 33 + "y\n\n\n" + " " * 32 + "z" + " " * 100
    assert splitter.split(text) == llama_cpp_partition(text, runs)
    ids = dict(runs)
    assert splitter.split("x" + " " * 33 + "y") == ["x", ids[" " * 31], ids[" " * 2], "y"]
    assert splitter.split(" " * 32) == [ids[" " * 31], " "]


def test_longest_wins_over_leftmost():
    specials = ordered(["XY", "YZZ"])
    splitter = SpecialTokenSplitter(specials)
    assert splitter.split("XYZZ") == ["X", 1]
    assert splitter.split("") == [] and splitter.split("abc") == ["abc"]
