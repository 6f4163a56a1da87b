"""The agent on the tiny synthetic Needle 3 model (random weights): every step's calls parse
and validate against the tool schemas, results go back as ``json.dumps``, the KV cache is
reused across steps, the run ends within max_steps and confidence comes from the session's
own pool (equal to ``Model.confidence`` over the same ids).

The random weights answer ``[]`` under the agent's grammar; a grammar that requires a call
(``min_calls=1``) makes the model call forever, so the bound is what ends the loop."""

import json

import jsonschema
import pytest

import needle_wgpu
from needle_wgpu import Agent, tool
from needle_wgpu.grammar import Limits
from needle_wgpu.grammar.tool_calls import tool_call_grammar
from needle_wgpu.synth import synthesize

pytestmark = pytest.mark.gpu

CALLS = []


@tool
def f(n: int):  # short: the tiny model's context is 256 positions and the prompt spells it out
    CALLS.append(n)
    return n * 2


SCHEMA = f.parameters


@pytest.fixture(scope="module")
def model(device):
    return needle_wgpu.load(synthesize("tiny", 0), device=device)


def test_the_agent_grammar_lets_the_model_answer(model):
    with Agent(model, tools=[f]) as agent:
        result = agent.run("go", max_tokens=40)
        assert result.finish_reason == "answer" and result.steps == 0 and result.turns[0]["calls"] == []
        assert result.answer == "<tool_call>[]</tool_call>" and 0.0 <= result.confidence <= 1.0


@pytest.mark.slow  # 5-15 s on lavapipe: three prefills and ~110 masked decode steps
def test_a_model_that_always_calls_stops_at_max_steps(model):
    CALLS.clear()
    with Agent(model, tools=[f], max_steps=1) as agent:  # two turns fill the tiny context
        # one-digit numbers and no reasoning keep two turns inside the context
        agent.constraint = model.constraint("test:f required", lambda: tool_call_grammar(
            [f.schema], Limits(int_digits=1), think_bytes=0, min_calls=1))
        result = agent.run("go", max_tokens=60, temperature=1.5, seed=3)
        assert result.finish_reason == "max_steps" and result.steps == 1, [t["text"] for t in result.turns]
        assert len(result.turns) == 2 and result.pending_calls == result.turns[-1]["calls"] != []
        for turn in result.turns:
            assert turn["calls"] is not None and not turn["problems"], turn["text"]
            for call in turn["calls"]:
                assert call["name"] == "f"
                jsonschema.Draft7Validator(SCHEMA).validate(call["arguments"])
        assert [c["arguments"]["n"] for c in result.function_calls] == CALLS
        assert result.results == [2 * n for n in CALLS]
        fed = [m["content"] for m in agent.conversation.messages if m["role"] == "tool"]
        assert fed == [json.dumps(t["results"]) for t in result.turns if t["results"]]
        stats = [t["stats"] for t in result.turns]
        for before, after in zip(stats, stats[1:]):
            assert after.reused == before.context_used and not after.new_session
            assert after.prefilled == after.prompt_tokens - after.reused
        assert 0.0 <= result.confidence <= 1.0
        ids = agent.conversation.cached
        assert result.confidence == pytest.approx(model.confidence(ids), abs=1e-4)
