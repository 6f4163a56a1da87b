"""Constrained tool calls end to end on the tiny synthetic Needle 3 model: whatever the (random)
weights prefer, every answer parses into known tool names with schema-valid arguments."""

import json

import jsonschema
import pytest

import needle_wgpu
from needle_wgpu.errors import InputError
from needle_wgpu.synth import synthesize

pytestmark = pytest.mark.gpu

TOOLS = [  # short: the tiny model's context is 256 positions, the prompt spells them out
    {"name": "timer", "parameters": {"type": "object", "properties": {"m": {"type": "integer", "maximum": 90},
                                                                      "t": {"type": "string", "maxLength": 4}},
                                     "required": ["m"]}},
    {"name": "lit", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def model(device):
    return needle_wgpu.load(synthesize("tiny", 0), device=device)


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 1), (1.5, 2), (3.0, 3)])
def test_constrained_tool_calls_always_parse(model, temperature, seed):
    result = model.generate(query="lights", tools=TOOLS, temperature=temperature, seed=seed,
                            max_tokens=256)
    assert result.finish_reason == "eos", result.text
    completion = result.completion
    assert completion.tool_calls is not None and not any("invalid" in p for p in completion.problems), result.text
    for call in completion.tool_calls:
        assert call["name"] in SCHEMAS
        jsonschema.Draft7Validator(SCHEMAS[call["name"]]).validate(call["arguments"])
    assert "mask_s" in result.timings


def test_unconstrained_and_bad_schemas(model):
    free = model.generate(query="hi", tools=TOOLS, constrained=False, max_tokens=8)
    assert free.completion is not None and "mask_s" not in free.timings
    with pytest.raises(InputError):
        model.generate(query="hi", tools=[{"name": "x", "parameters": {"type": "string", "pattern": "a"}}],
                       constrained=True, max_tokens=4)
