"""Batched decode steps (models/batch.py): every sequence's ids in a batch are the ids it gets
alone, whoever else is in the batch, whenever it joins, and on a reused session."""

import pytest

from needle_wgpu.errors import ContextFullError, InputError
from needle_wgpu.models.batch import StepRequest
from needle_wgpu.sampling import Sampling

pytestmark = pytest.mark.gpu

STEPS = 10
REQUESTS = [  # prompt, sampling, decode steps, the batch step at which it joins
    ([1, 5, 9, 13], Sampling(), STEPS, 0),
    ([2, 7, 7, 7, 7, 7, 30, 31, 32], Sampling.saturate(temperature=0.8, seed=5), 4, 0),
    ([3], Sampling.saturate(temperature=1.0, top_k=5, top_p=0.9, seed=9), STEPS, 2),
    ([40, 41, 42, 43, 44, 45], Sampling.saturate(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={68: 3.0}),
     STEPS, 5),
    ([50, 51] * 20, Sampling.saturate(temperature=0.7, min_p=0.05, seed=11), 6, 5),
]
CONTEXT = 64


def alone(gpu, prompt, sampling, steps, **extra):
    session = gpu.session(context=CONTEXT)
    try:
        out = [session.prefill(prompt, sampling, **extra)]
        out += [session.step(sampling, **extra) for _ in range(steps)]
        return out
    finally:
        session.close()


def batched(gpu, requests, capacity, slab=False, **extra):
    """Run ``requests`` through one batch of ``capacity`` rows and a pool of ``capacity``
    sessions: each joins at its step (prefilled between steps), leaves when done, and its session
    is rewound and reused by the next to join. ``slab``: the pool's sessions are the batch's
    (``batch.session``: the dense family's caches in its slab, attended in one dispatch a layer),
    every other one when "mixed"."""
    batch = gpu.batch(capacity)
    opener = lambda i: batch.session(context=CONTEXT) if slab is True or (slab == "mixed" and i % 2) else \
        gpu.session(context=CONTEXT)
    free = [opener(i) for i in range(capacity)]
    pool = list(free)
    active, out, t = {}, {}, 0
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][3])
    try:
        while waiting or active:
            while waiting and requests[waiting[0]][3] <= t and free:
                i = waiting.pop(0)
                prompt, sampling = requests[i][:2]
                session = free.pop()
                if session.rewindable:
                    session.rewind(0)
                else:  # a ring (sliding window) cannot go back to 0: a fresh session, as the pool does
                    pool.remove(session)
                    session.close()
                    session = opener(len(pool))
                    pool.append(session)
                active[i] = session
                out[i] = [session.prefill(prompt, sampling, **extra)]
            rows = sorted(active)
            ids = batch.step([StepRequest(active[i], requests[i][1], **extra) for i in rows])
            for i, token in zip(rows, ids):
                out[i].append(token)
                if len(out[i]) == requests[i][2] + 1:
                    free.append(active.pop(i))
            t += 1
        return [out[i] for i in range(len(requests))], batch.plans_built
    finally:
        batch.close()
        for session in pool:
            session.close()


@pytest.mark.parametrize("capacity, slab", [(2, False), (4, False), (2, True), (4, True), (4, "mixed")])
def test_batched_ids_are_the_ids_alone(synthetic_llama, capacity, slab):
    gpu = synthetic_llama.gpu
    expected = [alone(gpu, prompt, sampling, steps) for prompt, sampling, steps, _ in REQUESTS]
    got, built = batched(gpu, REQUESTS, capacity, slab=slab)
    assert got == expected
    assert built >= 2  # the composition changed as sequences joined and left


def test_slab_rows_attend_in_one_dispatch_a_layer(synthetic_llama):
    """The batch's own sessions share its slab: a step of 3 of them runs qk_rope and attention
    once a layer for all three (a session of its own buffers still once a row); closing them
    gives the slab's memory back."""
    gpu = synthetic_llama.gpu
    layers = gpu.geometry.num_layers
    batch = gpu.batch(4)
    try:
        kv = gpu.device.counters.bytes_allocated.get("kv", 0)
        pooled = [batch.session(context=CONTEXT) for _ in range(3)]
        slot_bytes = 4 * sum(pooled[0].slab.slot_words)
        # the page of 4 slots is made with the first: one slot's worth free, counted as held
        assert batch.idle_slots() == 1 and gpu.device.counters.bytes_allocated["kv"] - kv == 4 * slot_bytes
        own = gpu.session(context=CONTEXT)
        for i, session in enumerate(pooled + [own]):
            session.prefill([3 + i, 4, 5 + i], Sampling())
        counts = []
        for rows in (pooled, pooled + [own]):
            batch.step([StepRequest(session, Sampling()) for session in rows])
            labels = [d.label for d in next(reversed(batch._plans.values())).dispatches]  # this step's plan
            counts.append(tuple(sum(label.split()[0] == op and "residual" not in label for label in labels)
                                for op in ("attention", "qk_rope")))
        assert counts == [(layers, layers), (2 * layers, 2 * layers)]
        live = gpu.device.counters.live_bytes
        slab = pooled[0].slab
        assert slab is not None and slab is pooled[2].slab and own.slab is None
        for session in pooled:
            batch.forget(session)
            session.close()
        assert not slab.pages and slab.partials is None and gpu.device.counters.live_bytes < live
        own.close()
    finally:
        batch.close()


def test_batched_logprobs_and_masks_are_those_alone(synthetic_llama):
    gpu = synthetic_llama.gpu
    rows = gpu.geometry.head_rows
    allowed = bytearray(4 * (-(-rows // 32)))
    for token in (4, 9, 68, 100, 106):
        allowed[token // 8] |= 1 << (token % 8)
    extra = {"mask": bytes(allowed), "top_logprobs": 3}
    requests = [(prompt, sampling, 4, join) for prompt, sampling, _, join in REQUESTS[:3]]
    expected = [alone(gpu, prompt, sampling, steps, **extra) for prompt, sampling, steps, _ in requests]
    got, _ = batched(gpu, requests, 3, **extra)
    assert [[token for token, _ in ids] for ids in got] == [[token for token, _ in ids] for ids in expected]
    assert [[lp.as_dict() for _, lp in ids] for ids in got] == [[lp.as_dict() for _, lp in ids] for ids in expected]
    assert all(token in (4, 9, 68, 100, 106) for ids in got for token, _ in ids)


def test_batch_refusals(synthetic_llama):
    gpu = synthetic_llama.gpu
    batch = gpu.batch(2)
    sessions = [gpu.session(context=4) for _ in range(3)]
    try:
        for session in sessions:
            session.prefill([1, 2, 3], Sampling())
        with pytest.raises(InputError):
            batch.step([StepRequest(s, Sampling()) for s in sessions])  # more rows than the batch has
        with pytest.raises(InputError):
            batch.step([StepRequest(sessions[0], Sampling())] * 2)  # one session twice
        with pytest.raises(InputError):
            batch.step([])
        assert len(batch.step([StepRequest(sessions[0], Sampling())])) == 1
        with pytest.raises(ContextFullError):  # 4 positions: the prompt's 3 and one step
            batch.step([StepRequest(sessions[0], Sampling()), StepRequest(sessions[1], Sampling())])
        assert sessions[1].position == 3  # a refused step advanced nobody
    finally:
        batch.close()
        for session in sessions:
            session.close()


def test_slab_kinds_other_batches_and_double_close(synthetic_llama):
    """One kind at a time in the batch's slab: a session of another context, and one in another
    batch's slab, step in the same batch on their own buffers' path, each with its ids alone; a
    session closed twice gives its slot back once (never another session's)."""
    gpu = synthetic_llama.gpu
    batch, other = gpu.batch(4), gpu.batch(4)
    prompts = ([1, 5, 9, 13], [2, 7, 30], [3, 4, 5, 6, 7], [40, 41])
    expected = [alone(gpu, prompt, Sampling(), 6) for prompt in prompts]
    try:
        sessions = [batch.session(context=CONTEXT), batch.session(context=48), other.session(context=CONTEXT),
                    batch.session(context=CONTEXT)]
        assert sessions[0].slab is sessions[3].slab is not None and sessions[1].slab is None
        assert sessions[2].slab is not None and sessions[2].slab is not sessions[0].slab
        got = [[session.prefill(prompt, Sampling())] for session, prompt in zip(sessions, prompts)]
        for _ in range(6):
            for out, token in zip(got, batch.step([StepRequest(session, Sampling()) for session in sessions])):
                out.append(token)
        assert got == expected
        first, last = sessions[0], sessions[3]
        batch.forget(first)
        first.close()
        again = batch.session(context=CONTEXT)  # takes the slot the first gave back
        first.close()  # a second close: nothing more
        assert again.slot is not None and again.slot in again.slab.taken and last.slot in last.slab.taken
        assert batch.session(context=CONTEXT).slot not in (again.slot, last.slot)
    finally:
        batch.close()
        other.close()


def test_forgotten_requests_leave_the_batch_flat(synthetic_llama):
    """A server's requests each bring a sampling of their own into the batch's sampler pieces:
    ``forget`` at a request's end frees them, so the device's live bytes stay where the first
    request left them."""
    gpu = synthetic_llama.gpu
    batch = gpu.batch(2)
    sessions = [batch.session(context=CONTEXT) for _ in range(2)]
    try:
        levels = []
        for seed in range(5):
            sampling = Sampling.saturate(temperature=0.9, seed=seed, logit_bias={5: 1.0 + seed})
            for session in sessions:  # the sessions' own plans: one greedy prefill
                session.rewind(0)
                session.prefill([1, 2, 3 + seed], Sampling())
            for _ in range(2):
                batch.step([StepRequest(session, sampling) for session in sessions])
            for session in sessions:
                batch.forget(session)
            levels.append(gpu.device.counters.live_bytes)
        assert levels[1:] == levels[1:2] * 4, levels
    finally:
        for session in sessions:
            session.close()
        batch.close()


NEEDLE3_REQUESTS = [
    ([1, 5, 9, 13], Sampling(), STEPS, 0),
    ([2, 7, 7, 7, 7, 7, 30, 31, 32], Sampling.saturate(temperature=0.8, seed=5), 4, 0),
    ([3, 4], Sampling.saturate(temperature=1.0, top_k=5, top_p=0.9, seed=9), STEPS, 2),
    ([40, 41, 42, 43, 44, 45], Sampling.saturate(repetition_penalty=1.3, logit_bias={68: 3.0}), STEPS, 5),
]


@pytest.mark.parametrize("capacity, slab", [(2, False), (3, True), (3, "mixed")])
def test_needle3_batched_ids_are_the_ids_alone(needle3_tiny, capacity, slab):
    gpu = needle3_tiny.gpu
    expected = [alone(gpu, prompt, sampling, steps) for prompt, sampling, steps, _ in NEEDLE3_REQUESTS]
    got, built = batched(gpu, NEEDLE3_REQUESTS, capacity, slab=slab)
    assert got == expected
    assert built >= 2


@pytest.mark.parametrize("kv", ["int8", "f32"])
def test_needle3_slab_rows_attend_in_one_dispatch_a_layer(needle3_tiny, kv):
    """Needle 3's plain sessions made by the batch share its slab (int8 or f32 caches): each
    row's qkv_post writes its slot, then one attention dispatch a layer takes the rows; the ids
    are those alone."""
    gpu = needle3_tiny.gpu
    layers = len(gpu.rung.blocks)
    prompts = ([1, 5, 9, 13], [2, 7, 30], [40, 41, 42])
    expected = []
    for prompt in prompts:
        session = gpu.session(context=CONTEXT, kv=kv)
        try:
            expected.append([session.prefill(prompt, Sampling())] + [session.step(Sampling()) for _ in range(5)])
        finally:
            session.close()
    batch = gpu.batch(3)
    sessions = [batch.session(context=CONTEXT, kv=kv) for _ in prompts]
    try:
        assert all(session.slab is sessions[0].slab is not None for session in sessions)
        got = [[session.prefill(prompt, Sampling())] for session, prompt in zip(sessions, prompts)]
        for _ in range(5):
            for out, token in zip(got, batch.step([StepRequest(session, Sampling()) for session in sessions])):
                out.append(token)
        assert got == expected
        labels = [d.label for d in next(reversed(batch._plans.values())).dispatches]
        assert sum(label.split()[0] == "attention" for label in labels) == layers
        assert sum(label.split()[0] == "qkv_post" for label in labels) == 3 * layers
    finally:
        for session in sessions:
            session.close()
        batch.close()


def test_smollm2_batched_ids_are_the_ids_alone(smollm2):
    """The real default model: greedy and seeded requests, joining at different steps."""
    gpu = smollm2.gpu
    requests = [(ids, sampling, 4, join) for ids, sampling, _, join in REQUESTS[:3]]
    expected = [alone(gpu, prompt, sampling, steps) for prompt, sampling, steps, _ in requests]
    got, _ = batched(gpu, requests, 3, slab=True)
    assert got == expected


ARCHS = ["qwen2", "qwen3moe", "olmoe", "gemma3", "smollm3", "granite", "olmo2", "gemma2", "phi3"]


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory, device):
    import needle_wgpu
    from needle_wgpu.synth_gguf import write_dense_gguf
    from test_dense_reference import SYNTH

    root = tmp_path_factory.mktemp("batch_archs")
    return lambda arch: needle_wgpu.load(str(write_dense_gguf(root / f"{arch}.gguf", SYNTH[arch][0],
                                                              tokenizer="bytes")), device=device)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_batches_to_its_ids_alone(arch_models, arch):
    """The rules each architecture adds (MoE routes, sliding windows, multipliers, post-norms,
    soft caps, unrotated layers, fused projections) hold row by row in a batch."""
    gpu = arch_models(arch).gpu
    assert gpu.capabilities.batch
    requests = [(prompt, sampling, 4, join) for prompt, sampling, _, join in REQUESTS[:4]]
    expected = [alone(gpu, prompt, sampling, steps) for prompt, sampling, steps, _ in requests]
    got, _ = batched(gpu, requests, 3, slab="mixed")
    assert got == expected


def test_convolution_blocks_step_one_by_one(arch_models):
    """lfm2's sessions keep a convolution ring each: the model declares no batched step, and
    asking for one anyway is refused by name (the server then steps its sessions in turn)."""
    from needle_wgpu.errors import UnsupportedModelError

    gpu = arch_models("lfm2").gpu
    assert not gpu.capabilities.batch
    with pytest.raises(UnsupportedModelError, match="lfm2"):
        gpu.batch(2)
