"""A conversation turn under a grammar (``Conversation.stream(constraint=...)``): on a random
synthetic model every reply is a schema-valid JSON document, the next turn still reuses the
KV cache, and a budget no answer fits ends the turn without running the model."""

from __future__ import annotations

import json

import jsonschema
import pytest

import needle_wgpu
from needle_wgpu.grammar import compile_schema
from needle_wgpu.synth_gguf import SynthDense, write_dense_gguf

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory, device):
    path = write_dense_gguf(tmp_path_factory.mktemp("conv") / "llama.gguf", SynthDense(arch="llama", seed=5),
                            tokenizer="bytes")
    return needle_wgpu.load(str(path), device=device)


def test_constrained_turns_validate_and_keep_the_cache(model):
    constraint = model.constraint("schema:trip", lambda: compile_schema(SCHEMA))
    assert model.constraint("schema:trip", lambda: compile_schema({})) is constraint  # built once per key
    conversation = model.conversation("Answer in JSON.", context=256)
    try:
        for turn, (text, temperature) in enumerate((("Plan a trip.", 0.0), ("Another one.", 1.5))):
            reply = conversation.send(text, max_tokens=60, temperature=temperature, seed=turn,
                                      constraint=constraint)
            jsonschema.validate(json.loads(reply["content"]), SCHEMA)
            assert conversation.turns[-1].finish_reason == "eos"  # EOS, where the grammar accepts
        one, two = conversation.turns
        assert two.reused == one.context_used and not two.rewound
    finally:
        conversation.close()


def test_a_budget_no_answer_fits_runs_nothing(model, device):
    constraint = model.constraint("schema:trip", lambda: compile_schema(SCHEMA))
    conversation = model.conversation(context=256)
    try:
        submits = device.counters.submits
        reply = conversation.send("Plan a trip.", max_tokens=3, constraint=constraint)
        assert reply["content"] == "" and conversation.turns[-1].finish_reason == "length"
        assert device.counters.submits == submits
        with pytest.raises(needle_wgpu.errors.InputError):
            conversation.send("Again.", constraint="not a constraint")
        assert conversation.messages[-1]["role"] == "assistant"  # the bad call took its message back
    finally:
        conversation.close()
