"""Per-step cost of constrained decoding's masks (pure Python): a Needle 3 tool-call grammar over
the 8,192-id synthetic Needle tokenizer and over SmolLM2's 49,152-id GGUF vocabulary. Prints the
trie build, the first (uncached) masks and the per-step mean over a random constrained walk."""

from __future__ import annotations

import random
import sys
import time

from needle_wgpu.grammar import Automaton, Constraint, Vocabulary
from needle_wgpu.grammar.tool_calls import tool_call_grammar

TOOLS = [{"name": "set_timer", "parameters": {"type": "object", "properties": {
    "minutes": {"type": "integer", "minimum": 1, "maximum": 600}, "label": {"type": "string", "maxLength": 40}},
    "required": ["minutes"]}},
    {"name": "lights", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall", "bedroom"]},
        "level": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["on"]}}]


def vocabularies():
    from needle_wgpu.formats.needle3_tokenizer import synthetic_tokenizer

    yield "needle (8,192, synthetic)", lambda: Vocabulary.of_tokenizer(synthetic_tokenizer(8192), eos_ids=(1, 5))
    try:
        from needle_wgpu.default_model import smollm2_path
        from needle_wgpu.formats.gguf import open_gguf
        from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf

        path = smollm2_path()
    except Exception as exc:  # not installed
        print(f"SmolLM2 skipped: {exc}", file=sys.stderr)
        return
    yield "smollm2 (49,152)", lambda: Vocabulary.of_tokenizer(tokenizer_from_gguf(open_gguf(path).metadata()))


def main() -> int:
    for name, build in vocabularies():
        started = time.perf_counter()
        vocabulary = build()
        trie_s = time.perf_counter() - started
        constraint = Constraint(Automaton(tool_call_grammar(TOOLS)), vocabulary)
        rng = random.Random(0)
        times = []
        for run in range(3):
            matcher = constraint.matcher()
            budget = 400
            for step in range(budget):
                started = time.perf_counter()
                allowed = matcher.allowed_ids(budget - step)
                times.append(time.perf_counter() - started)
                token = rng.choice(allowed)
                matcher.accept(token)
                if matcher.ended:
                    break
        times_ms = sorted(t * 1000 for t in times)
        print(f"{name}: trie {trie_s * 1000:.0f} ms, {len(times)} steps, mean {sum(times_ms) / len(times_ms):.2f} ms, "
              f"median {times_ms[len(times_ms) // 2]:.3f} ms, max {times_ms[-1]:.0f} ms, {constraint.walks} walks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
