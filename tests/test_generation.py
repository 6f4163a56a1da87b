"""The one generation loop (needle_wgpu/generation.py) as the surfaces drive it, over a scripted
session (no GPU) with SmolLM2's tokenizer: the streamed text is exactly the result's text (a stop
string is held back, never streamed and then cut), and ``Model.stream``, ``Conversation`` and
``Model.chat`` end a generation for the same reasons."""

import pytest

from needle_wgpu.api import GenerationResult, Model
from needle_wgpu.generation import FINISH_REASONS, Decoded, Steps, decode, openai_finish_reason
from needle_wgpu.sampling import Sampling
from test_conversation import ScriptedGpu

REPLY = "The answer is 42. END of it"


def streamed(model, **options):
    result = GenerationResult("", [], "empty", 0)
    events = list(model.stream("Question:", result=result, **options))
    return events, result


@pytest.mark.parametrize("stop", [["END"], ["42. E", "x"], ["is 4"], [" of it"]])
def test_a_stop_string_is_never_streamed(stop):
    events, result = streamed(Model(ScriptedGpu([REPLY])), stop=stop)
    joined = "".join(e.text for e in events)
    assert result.finish_reason == "stop"
    assert joined == result.text == REPLY[: REPLY.index(stop[0])]
    assert all(e.id is not None for e in events)  # nothing was held when it stopped


def test_a_partial_stop_string_held_at_the_end_is_streamed_last():
    # "42. EN" may begin "42. ENDING"; the reply ends (EOS) before it can complete
    events, result = streamed(Model(ScriptedGpu(["The answer is 42. EN"])), stop=["42. ENDING"])
    assert result.finish_reason == "eos"
    assert "".join(e.text for e in events) == result.text == "The answer is 42. EN"
    assert events[-1].id is None and events[-1].text.endswith("EN")  # the held-back tail, flushed
    assert [e.id for e in events if e.id is not None] == result.ids


def test_an_end_of_generation_id_ends_every_surface_alike():
    model = Model(ScriptedGpu(["Paris.", "Paris.", "Paris."]))
    _, result = streamed(model)
    conversation = model.conversation()
    conversation.send("Capital of France?")
    answer = model.chat([{"role": "user", "content": "Capital of France?"}])
    assert result.finish_reason == conversation.turns[-1].finish_reason == "eos"
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_ends_a_turn_as_it_ends_a_stream():
    model = Model(ScriptedGpu([REPLY, REPLY]))
    conversation = model.conversation()
    pieces = list(conversation.stream("Q?", stop=["END"]))
    assert conversation.turns[-1].finish_reason == "stop"
    assert "".join(pieces) == conversation.messages[-1]["content"] == "The answer is 42. "
    chunks = list(model.chat([{"role": "user", "content": "Q?"}], stop=["END"], stream=True))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "The answer is 42. " and chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_the_budget_ends_with_length_and_the_context_with_length():
    events, result = streamed(Model(ScriptedGpu([REPLY])), max_tokens=3)
    assert result.finish_reason == "length" and len(result.ids) == 3
    assert "".join(e.text for e in events) == result.text


def test_should_stop_ends_with_stopped_on_every_surface():
    model = Model(ScriptedGpu([REPLY, REPLY]))
    _, result = streamed(model, should_stop=lambda done, total: done >= 2 and total == 256)
    assert result.finish_reason == "stopped" and len(result.ids) == 2
    conversation = model.conversation()
    reply = conversation.send("Q?", should_stop=lambda done, total: done >= 2 and total == 256)
    assert conversation.turns[-1].finish_reason == "stopped" and conversation.turns[-1].completion_tokens == 2
    assert reply == conversation.messages[-1] and reply["content"] == "The answer"


def test_a_turn_stopped_during_its_prefill_is_taken_back():
    conversation = Model(ScriptedGpu([REPLY])).conversation()
    reply = conversation.send("Q?", should_stop=lambda done, total: done > 0)  # before the second chunk
    assert reply == {"role": "assistant", "content": ""} and conversation.messages == []
    assert conversation.turns[-1].finish_reason == "stopped"


def test_no_room_runs_nothing():
    gpu = ScriptedGpu([REPLY])
    session = gpu.session(context=8)
    out = Decoded()
    assert list(decode(Steps(session), [1, 2, 3], out, sampling=Sampling(), budget=0, stop_ids={2})) == []
    assert out.finish_reason == "length" and not out.sampled and gpu.prefills == []


def test_every_finish_reason_maps_to_one_of_openais():
    assert {openai_finish_reason(r) for r in FINISH_REASONS} == {"stop", "length", "tool_calls"}
    assert openai_finish_reason("eos") == openai_finish_reason("stop") == "stop"


def test_the_round_length_defaults_by_adapter_kind_and_saturates():
    from needle_wgpu.generation import MAX_ROUND_TOKENS, round_tokens
    from needle_wgpu.gpu.device import ROUND_TOKENS, Device

    software, hardware = Device(), Device()
    software.software_rasterizer, hardware.software_rasterizer = True, False
    assert round_tokens(None, software) == ROUND_TOKENS["software"] == 1
    assert round_tokens(None, hardware) == ROUND_TOKENS["hardware"] > 1
    assert round_tokens(None, None) == 1  # a model without a device (a scripted one)
    for value, expected in ((3, 3), (3.9, 3), (0, 1), (-5, 1), (10 ** 9, MAX_ROUND_TOKENS),
                            (float("nan"), 4), ("x", 4), (float("inf"), 4)):
        assert round_tokens(value, hardware) == expected, value


def test_a_round_that_overshoots_is_taken_back():
    """Steps with rounds of 4 over a scripted session: the ids past the generation's end are
    discarded and the session's position is what one step at a time leaves."""

    class Rounds:
        rewindable, max_rewind, context = True, 0, 64

        def __init__(self):
            self.position, self.rounds = 0, []

        def prefill(self, ids, sampling=None, **extra):
            self.position = len(ids)
            return 10

        def decode_round(self, count, sampling):
            return self.collect_round(self.submit_round(count, sampling))

        def submit_round(self, count, sampling):
            self.rounds.append(count)
            start = self.position
            self.position += count
            return [11 + start - 3 + i for i in range(count)]  # ids 11, 12, ... by position

        def collect_round(self, submitted):
            return submitted

        def step(self, sampling, **extra):
            raise AssertionError("a plain step while rounds are asked for")

        def rewind(self, position):
            self.position = position

    session = Rounds()
    out = Decoded()
    list(decode(Steps(session, round_tokens=4), [1, 2, 3], out, sampling=Sampling(), budget=6, stop_ids={14}))
    assert out.ids == [10, 11, 12, 13] and out.finish_reason == "eos"
    # four steps fed 10..13; the round ahead (pipelined: submitted before the first was read,
    # one step as the budget allows) is taken back with it
    assert session.rounds == [4, 1] and session.position == 3 + 4
    session, out = Rounds(), Decoded()
    list(decode(Steps(session, round_tokens=4), [1, 2, 3], out, sampling=Sampling(), budget=6, stop_ids=set()))
    assert out.ids == [10, 11, 12, 13, 14, 15] and session.rounds == [4, 1]  # the budget bounds a round
    assert session.position == 3 + 5
    # A session that rewinds only over a ring's spare slots runs one round at a time.
    session, out = Rounds(), Decoded()
    session.rewindable, session.max_rewind = False, 3
    list(decode(Steps(session, round_tokens=4), [1, 2, 3], out, sampling=Sampling(), budget=9, stop_ids={14}))
    assert out.ids == [10, 11, 12, 13] and session.rounds == [4] and session.position == 3 + 4
