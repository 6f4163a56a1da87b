"""The generated code-point ranges (formats/unicode_ranges.py) against unicodedata, and the
character classes the BPE pre-tokenizers build from them (dense-gguf spec §5.2)."""

import importlib.util
import re
import sys
import unicodedata
from pathlib import Path

import pytest

from needle_wgpu.formats import unicode_ranges
from needle_wgpu.formats.bpe_tokenizer import _expand

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("LETTER", "NUMBER", "PUNCTUATION", "WHITESPACE")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_unicode_ranges",
                                                  ROOT / "tools" / "gen_unicode_ranges.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated():
    return _generator().compute_ranges()


def _points(spans):
    return {cp for a, b in spans for cp in range(a, b + 1)}


def test_ranges_match_unicodedata(generated):
    if unicodedata.unidata_version == unicode_ranges.UNIDATA_VERSION:
        for name in NAMES:
            assert getattr(unicode_ranges, name) == generated[name], name
        assert _generator().render(generated) == \
            (ROOT / "needle_wgpu" / "formats" / "unicode_ranges.py").read_text(encoding="utf-8")
    else:
        # Another Unicode version: assigned characters keep their class, new ones are added;
        # the shipped constants must still be a subset of what this interpreter says.
        for name in NAMES:
            assert _points(getattr(unicode_ranges, name)) <= _points(generated[name]), name


def test_ranges_are_sorted_disjoint_and_maximal():
    for name in NAMES:
        spans = getattr(unicode_ranges, name)
        assert all(a <= b for a, b in spans)
        assert all(b1 + 1 < a2 for (_, b1), (a2, _) in zip(spans, spans[1:])), name
        assert spans[-1][1] <= sys.maxunicode


def test_whitespace_is_llama_cpp_white_space_not_python_s():
    ws = _points(unicode_ranges.WHITESPACE)
    assert ws == {0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                  0x2028, 0x2029, 0x202F, 0x205F, 0x3000}
    # Python's \s also takes the information separators U+001C..U+001F; llama.cpp does not.
    assert all(re.match(r"\s", chr(c)) for c in range(0x1C, 0x20))
    assert not ws & set(range(0x1C, 0x20))


@pytest.mark.parametrize("name, expression", [("LETTER", r"\p{L}"), ("NUMBER", r"\p{N}"),
                                              ("PUNCTUATION", r"\p{P}"), ("WHITESPACE", r"\s")])
def test_expanded_class_matches_exactly_its_ranges(name, expression):
    inside = re.compile(_expand(f"[{expression}]"))
    outside = re.compile(_expand(expression))
    spans = getattr(unicode_ranges, name)
    probes = {cp for a, b in spans for cp in (a - 1, a, b, b + 1) if 0 <= cp <= sys.maxunicode}
    members = _points(spans)
    for cp in sorted(probes):
        expected = cp in members
        assert bool(inside.fullmatch(chr(cp))) is expected, (name, hex(cp))
        assert bool(outside.fullmatch(chr(cp))) is expected, (name, hex(cp))


def test_negated_classes():
    not_space = re.compile(_expand(r"\S"))
    assert not_space.fullmatch("\x1c") and not_space.fullmatch("a")
    assert not not_space.fullmatch("\u3000") and not not_space.fullmatch("\x85")
    other = re.compile(_expand(r"[^\s\p{L}\p{N}]"))
    assert other.fullmatch("!") and other.fullmatch("\u0301") and other.fullmatch("😀")
    assert not other.fullmatch("é") and not other.fullmatch("٣") and not other.fullmatch("\xa0")
