"""The Ray Serve deployment on a local single-node Ray: 2 replicas of the app behind Ray's
router answer as one server does (the same answers, greedy and seeded), streamed too."""

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from .conftest import ROOT, free_port, live_server, models  # noqa: E402
from needle_wgpu.server import ServerConfig  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = [f"Name a colour, please ({i})." for i in range(6)]


def ask(client, i: int, **extra) -> str:
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}],
                                            max_tokens=8, temperature=0.7 if i % 2 else 0.0, seed=i, **extra)
    if extra.get("stream"):
        return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    return answer.choices[0].message.content


def test_two_replicas_answer_as_one_server_does(tiny_gguf):
    from ray import serve

    from needle_wgpu.server.ray_serve import deployment

    config = ServerConfig(models=models(tiny_gguf, context=128)[:1])
    with live_server(config) as (url, _):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as one:
            want = [ask(one, i) for i in range(len(PROMPTS))]
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"]}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(config, replicas=2, cpus_per_replica=0.5), name="needle", route_prefix="/",
                  blocking=False)
        status = serve.status().applications["needle"]
        replicas = status.deployments["needle-wgpu"].replica_states
        assert status.status == "RUNNING" and replicas.get("RUNNING") == 2
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=60) as replicated:
            assert [m.id for m in replicated.models.list()] == ["tiny"]
            got = [ask(replicated, i) for i in range(len(PROMPTS))]
            streamed = [ask(replicated, i, stream=True) for i in range(len(PROMPTS))]
        assert got == streamed == want
    finally:
        serve.shutdown()
        ray.shutdown()
