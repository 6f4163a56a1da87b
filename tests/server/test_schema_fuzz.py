"""A bounded fuzz of every operation of the server's own OpenAPI schema (schemathesis): bodies
that fit the schema and bodies that do not, with ``model`` often a served one so that the
engine runs. Not one answer may be a server error (5xx)."""

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from .conftest import live_server, models  # noqa: E402
from needle_wgpu.server import ServerConfig  # noqa: E402

pytestmark = pytest.mark.gpu

EXAMPLES = 40  # per operation and mode: a bounded run (about a minute on lavapipe)
MODELS = st.sampled_from(["tiny", "tiny", "needle", "gpt-4o"])


@pytest.fixture(scope="module")
def fuzzed(tiny_gguf):
    with live_server(ServerConfig(models=models(tiny_gguf, context=96))) as (url, _):
        yield url, schemathesis.openapi.from_url(url + "/openapi.json")


POSTS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings")]
GETS = [("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"), ("GET", "/metrics")]
# Negative bodies for the POSTs; a GET has no body, and a path string cannot break its schema.
CASES = [(m, p, mode) for m, p in POSTS for mode in ("positive", "negative")] + [(m, p, "positive") for m, p in GETS]


def test_the_schema_covers_every_route(fuzzed):
    _, schema = fuzzed
    found = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert found == set(POSTS + GETS)


@pytest.mark.parametrize("method,path,mode", CASES)
def test_no_generated_request_is_a_server_error(fuzzed, method, path, mode):
    url, schema = fuzzed
    strategy = schema[path][method].as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    statuses = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy, model=MODELS)
    def run(case, model):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        response = case.call(base_url=url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.text[:500])

    run()
    print(method, path, mode, dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= 1
