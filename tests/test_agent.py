"""The agent loop and Needle 3's multi-turn rendering over a scripted session (no GPU): turn 1
is ``prompt_ids`` id for id, later turns prefill only their new ids, tool results are
``json.dumps`` of the return values, a tool's exception is fed back, and a model that calls
forever stops at the bound. The GPU run is tests/gpu/test_agent.py."""

import json

import pytest

from needle_wgpu.formats.cact import CONFIDENCE_HEAD
from needle_wgpu.models.protocols import Capabilities
from needle_wgpu import Agent, InputError, tool
from needle_wgpu.api import Model
from needle_wgpu.errors import ContextFullError, UnsupportedModelError
from needle_wgpu.formats.needle3_tokenizer import synthetic_tokenizer
from needle_wgpu.chat.needle3 import Needle3Chat, prompt_ids

TOKENIZER = synthetic_tokenizer(512)
CHAT = Needle3Chat()


@tool
def add(a: int, b: int = 1) -> int:
    """Add two numbers."""
    return a + b


@tool
def fail(reason: str):
    """Always fails."""
    raise ValueError(f"no: {reason}")


def answer_ids(text: str) -> list:
    """A completion's ids as a model samples them (no dummy prefix before its first marker)."""
    ids = TOKENIZER.encode(text)
    return ids[ids.index(TOKENIZER.marker_id("<tool_call>") if "<think>" not in text[:7]
                         else TOKENIZER.marker_id("<think>")):]


class Geometry:
    vocab = head_rows = 512
    max_seq_len = 2048


class ScriptedSession:
    rewindable = False

    def __init__(self, gpu, context, confidence):
        self.gpu, self.context, self.position = gpu, context or 2048, 0
        self.fed, self.pending, self.scored = [], [], confidence

    def prefill(self, ids, sampling=None, mask=None):
        self.gpu.prefills.append(len(ids))
        self.fed += ids
        self.position += len(ids)
        reply = self.gpu.replies.pop(0) if len(self.gpu.replies) > 1 else self.gpu.replies[0]
        self.pending = answer_ids(reply) + [TOKENIZER.im_end_id]
        return self.pending.pop(0)

    def step(self, sampling, mask=None):
        self.position += 1
        return self.pending.pop(0)

    def confidence_logit_so_far(self):
        assert self.scored
        return 0.25 * len(self.fed) / self.position

    def close(self):
        pass


class ScriptedNeedle3:
    def __init__(self, replies, confidence=True):
        self.tokenizer, self.chat, self.geometry = TOKENIZER, CHAT, Geometry()
        self.replies, self.prefills, self.sessions = list(replies), [], []
        self.capabilities = Capabilities(heads=frozenset({CONFIDENCE_HEAD} if confidence else ()),
                                         confidence=confidence, mask=True)
        self.name, self.warnings, self.device = "needle-wgpu-scriptedneedle3", [], None

    def session(self, context=None, kv="f32", confidence=False):
        self.sessions.append(ScriptedSession(self, context, confidence))
        return self.sessions[-1]


def call(name, **arguments):
    return "<tool_call>" + json.dumps([{"name": name, "arguments": arguments}], separators=(",", ":")) + "</tool_call>"


def test_turn_one_renders_as_prompt_ids_and_later_turns_extend_it():
    tools = [add.schema]
    for system in (None, "", "  Be brief. "):
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
                   [{"role": "user", "content": "add 2 and 3"}]
        assert CHAT.render_ids(TOKENIZER, messages, tools) == prompt_ids(TOKENIZER, "add 2 and 3", tools, system)
    reply = answer_ids("<think>sum</think>" + call("add", a=2, b=3))
    history = [{"role": "user", "content": "add 2 and 3"},
               {"role": "assistant", "content": "ignored", "token_ids": reply}]
    first = prompt_ids(TOKENIZER, "add 2 and 3", tools)
    second = CHAT.render_ids(TOKENIZER, history + [{"role": "tool", "content": "[5]"}], tools)
    tail = "<|im_end|>\n<|im_start|>user\n<tool_result>[5]</tool_result><|im_end|>\n<|im_start|>assistant\n"
    tail_ids = TOKENIZER.encode(tail)
    assert second == first + reply + tail_ids[tail_ids.index(TOKENIZER.im_end_id):]
    # Without sampled ids the reply's text (and its OpenAI-style calls) is rendered instead.
    text = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}]}]
    assert CHAT.render_ids(TOKENIZER, text, []) == [TOKENIZER.bos_id] + TOKENIZER.encode(
        '<|im_start|>user\n<tools>[]</tools>\nq<|im_end|>\n<|im_start|>assistant\n'
        '<tool_call>[{"name":"add","arguments":{"a":1}}]</tool_call><|im_end|>\n')


def test_run_executes_feeds_results_and_reuses_the_cache():
    gpu = ScriptedNeedle3(["<think>adding</think>" + call("add", a=2, b=3), "<tool_call>[]</tool_call>"])
    agent = Agent(Model(gpu), tools=[add])
    result = agent.run("add 2 and 3", max_tokens=64)
    assert result.finish_reason == "answer" and result.steps == 1 and len(result.turns) == 2
    assert result.function_calls == [{"name": "add", "arguments": {"a": 2, "b": 3}}] and result.results == [5]
    assert result["results"] == [5] and result.reasoning is None and result.answer == "<tool_call>[]</tool_call>"
    assert result.turns[0]["reasoning"] == "adding"
    messages = agent.conversation.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[2]["content"] == json.dumps([5])
    one, two = (t["stats"] for t in result.turns)
    assert two.reused == one.context_used and not two.rewound and not two.new_session
    assert gpu.prefills == [one.prompt_tokens, two.prefilled] and len(gpu.sessions) == 1
    assert 0.5 < result.confidence < 1  # σ over the session's whole pool
    assert json.loads(json.dumps(result.as_dict()))["turns"][1]["stats"]["reused"] == two.reused
    with pytest.raises(KeyError):
        result["nope"]


def test_a_model_that_calls_forever_stops_at_max_steps():
    for max_steps, bound in ((3, 3), (0, 0), (100, 8), (float("nan"), 8), (-5, 0)):
        gpu = ScriptedNeedle3([call("add", a=1)])
        agent = Agent(Model(gpu), tools=[add], max_steps=max_steps)
        assert agent.max_steps == bound
        result = agent.run("count", max_tokens=64)
        assert result.steps == bound and result.finish_reason == "max_steps"
        assert len(result.turns) == bound + 1 and result.results == [2] * bound
        assert result.pending_calls == [{"name": "add", "arguments": {"a": 1}}]
        assert [t["stats"].new_session for t in result.turns] == [False] * (bound + 1)


def test_failures_are_fed_back_not_raised():
    calls = ("<tool_call>" + json.dumps([{"name": "fail", "arguments": {"reason": "x"}},
                                         {"name": "add", "arguments": {"b": 1}},
                                         {"name": "schema_only", "arguments": {}},
                                         {"name": "add", "arguments": {"a": 1, "c": 2}}]) + "</tool_call>")
    gpu = ScriptedNeedle3([calls, "<tool_call>[]</tool_call>"])
    schema_only = {"name": "schema_only", "parameters": {"type": "object", "properties": {}}}
    agent = Agent(Model(gpu), tools=[fail, add, schema_only], constrained=False)
    result = agent.run("go", max_tokens=256)
    assert result.results[0] == {"error": "ValueError: no: x"}
    assert result.results[1]["error"].startswith("TypeError") and "'a'" in result.results[1]["error"]
    assert result.results[2] == {"error": "tool 'schema_only' has no Python function"}
    assert "unknown arguments ['c']" in result.results[3]["error"]
    assert agent.conversation.messages[2]["content"] == json.dumps(result.results)


def test_a_second_run_continues_unless_stateless():
    gpu = ScriptedNeedle3(["<tool_call>[]</tool_call>"] * 4)
    agent = Agent(Model(gpu), tools=[add])
    agent.run("one", max_tokens=32)
    second = agent.run("two", max_tokens=32)
    assert second.turns[0]["stats"].reused > 0 and len(agent.conversation.messages) == 4
    agent.reset()
    assert agent.conversation.messages == [] and agent.conversation.session is None
    fresh = Agent(Model(gpu), tools=[add], stateless=True)
    fresh.run("one", max_tokens=32)
    again = fresh.run("two", max_tokens=32)
    assert again.turns[0]["stats"].reused == 0 and len(fresh.conversation.messages) == 2


def test_context_full_ends_the_run_with_what_it_has():
    gpu = ScriptedNeedle3([call("add", a=1)])
    agent = Agent(Model(gpu), tools=[add], context=400)
    result = agent.run("count", max_tokens=48)
    assert result.finish_reason == "context_full" and 0 < result.steps < 8
    assert agent.conversation.messages[-1]["role"] == "assistant"  # the unfed results were taken back
    with pytest.raises(ContextFullError):
        Agent(Model(ScriptedNeedle3([call("add", a=1)])), tools=[add], context=64).run("x" * 300, max_tokens=16)


def test_bad_arguments_are_input_errors():
    model = Model(ScriptedNeedle3(["<tool_call>[]</tool_call>"], confidence=False))
    with pytest.raises(InputError, match="two tools"):
        Agent(model, tools=[add, add])
    with pytest.raises(InputError, match="tools\\[0\\]"):
        Agent(model, tools=[3])
    with pytest.raises(InputError):
        Agent("not a model", tools=[add])
    with pytest.raises(InputError, match="unknown keyword"):
        Agent(model, tools=[add]).run("q", max_token=3)
    with pytest.raises(InputError, match="unknown keyword"):
        Agent(model, tools=[add], max_step=3)
    agent = Agent(model, tools=[add])
    assert agent.run("q", max_tokens=16).confidence is None  # no confidence head
    with pytest.raises(InputError):  # a schema outside the grammar's subset, constrained asked for
        Agent(model, tools=[{"name": "p", "parameters": {"type": "string", "pattern": "a"}}], constrained=True)


def test_a_format_without_a_tool_call_grammar_refuses_constrained():
    class NoCallFormat(Needle3Chat):
        tool_calls = None

    gpu = ScriptedNeedle3(["<tool_call>[]</tool_call>"])
    gpu.chat = NoCallFormat()
    with pytest.raises(UnsupportedModelError):
        Agent(Model(gpu), tools=[add], constrained=True)
    assert Agent(Model(gpu), tools=[add]).constraint is None  # the default decodes freely


def test_a_dense_agent_constrains_as_chat_does():
    """The tagged format (SmolLM2's template) has no grammar that may decline, so by default a
    dense agent decodes freely, as ``Model.chat(tool_choice="auto")``; ``constrained=True`` is
    ``tool_choice="required"``: every reply is one or more valid ``<tool_call>`` blocks."""
    from needle_wgpu.chat.tool_calls import TAGGED
    from test_conversation import ScriptedGpu

    model = Model(ScriptedGpu())
    assert model.chat_format.tool_calls is TAGGED and Agent(model, tools=[add]).constraint is None
    constraint = Agent(model, tools=[add], constrained=True).constraint
    call_ids = model.encode('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>')
    matcher = constraint.matcher()
    for token_id in call_ids:
        matcher.accept(token_id)
    assert matcher.accepting
    plain = model.encode("It is 5.")[0]
    assert not constraint.matcher().mask()[plain // 8] >> (plain % 8) & 1  # free text is refused
    assert model.generate(query="add", tools=[add.schema], constrained=True, max_tokens=0).finish_reason == "length"


def test_a_dense_model_runs_its_template_tool_calls():
    """SmolLM2's template and Qwen-style ``<tool_call>`` blocks (no answer grammar: unconstrained)."""
    from test_conversation import ScriptedGpu

    gpu = ScriptedGpu(['<tool_call>\n{"name": "add", "arguments": {"a": 4}}\n</tool_call>', "It is 5."])
    agent = Agent(Model(gpu), tools=[add])
    assert agent.constraint is None
    result = agent.run("add 4 and 1", max_tokens=64)
    assert result.finish_reason == "answer" and result.steps == 1 and result.results == [5]
    assert result.answer == "It is 5." and result.confidence is None
    assert agent.conversation.messages[2] == {"role": "tool", "content": "[5]"}
    one, two = (t["stats"] for t in result.turns)
    assert two.reused > 0 and two.prefilled == two.prompt_tokens - two.reused


def test_min_calls_takes_the_refusal_away():
    from needle_wgpu.grammar import Automaton, GrammarError
    from needle_wgpu.grammar.tool_calls import tool_call_grammar

    def accepts(nodes, text: bytes) -> bool:
        automaton = Automaton(nodes)
        state = automaton.advance_bytes(automaton.initial, text)
        return bool(state) and automaton.accepts(state)

    one_call = b'<tool_call>[{"name":"add","arguments":{"a":1}}]</tool_call>'
    assert accepts(tool_call_grammar([add.schema]), b"<tool_call>[]</tool_call>")
    assert not accepts(tool_call_grammar([add.schema], min_calls=1), b"<tool_call>[]</tool_call>")
    assert accepts(tool_call_grammar([add.schema], min_calls=1), one_call)
    with pytest.raises(GrammarError):
        tool_call_grammar([], min_calls=1)
