"""The server fuzzed from its own OpenAPI schema by schemathesis (issue 68), on loopback: bodies the
schema allows and bodies it does not, at every route. No answer is a server error, every status
is one the schema lists, every body has the content type and shape the schema says, and the
server serves a plain request afterwards; with and without an API key. A bounded example count
keeps it to seconds."""

from __future__ import annotations

import re

import httpx
import pytest
from hypothesis import HealthCheck, settings

import staticrt

schemathesis = pytest.importorskip("schemathesis", reason="the fuzzing tests need schemathesis: install the test extra")
pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")

from serving import client, running  # noqa: E402

from staticrt.serve import serve_backend  # noqa: E402

MODEL = "tiny-llama"


@pytest.fixture(scope="module", params=[None, "k3y"], ids=["open", "keyed"])
def key(request):
    return request.param


@pytest.fixture(scope="module")
def server(key):
    gen = staticrt.Generator(staticrt.load_model(MODEL), max_batch_size=2, max_cache_len=64)
    app, _ = serve_backend(gen.backend, name=MODEL, max_queue=4, api_key=key)
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def api(server, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return schemathesis.openapi.from_url(f"{server}/openapi.json", headers=headers)


schema = schemathesis.pytest.from_fixture("api")
CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


@schema.parametrize()
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_the_schema_describes_or_breaks_gets_a_server_error(case, key):
    """With a key, schemathesis sends it (and tries without it: 401, as described)."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    case.call_and_validate(checks=CHECKS, headers=headers)


def test_the_fuzzing_reached_the_model_and_the_server_serves_after_it(server, key):
    """Bodies the schema allows were answered (not all refused by a check), and a plain request still is."""
    metrics = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    finished = re.search(r'^staticrt_requests_finished_total\{outcome="length"\} (\S+)$', metrics, re.M)
    assert float(finished.group(1)) >= 1
    api = client(server, api_key=key or "none")
    reply = api.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert len(reply.choices[0].model_extra["token_ids"]) == 4
