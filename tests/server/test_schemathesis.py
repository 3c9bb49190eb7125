"""Property-based fuzzing of the generation routes (OpenAI's three, Anthropic's Messages)
from the server's own OpenAPI schema: no 5xx.

The schema is narrowed before fuzzing (max_tokens <= 4, n <= 2, max_tokens required for chat)
so each generated request runs in well under a second on a small CPU; prompts are
non-empty and in-vocabulary (the negative mode covers everything else).
"""

from __future__ import annotations

import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.model

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def server():
    with launch_server("--num-blocks", "256", "--max-model-len", "512") as running:
        yield running


def _narrowed_schema(raw: dict, model: str) -> dict:
    schemas = raw["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "MessagesRequest",
                 "ResponsesRequest"):
        # Unknown fields and models are 400s anyway; keep positive examples on the model path.
        schemas[name]["additionalProperties"] = False
        props = schemas[name]["properties"]
        props["model"] = {"anyOf": [{"type": "null"}, {"const": model}]}
        if "prompt" in props:  # token ids in the model's vocabulary, so most examples generate
            props["prompt"] = {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 49151},
                        "minItems": 1,
                        "maxItems": 64,
                    },
                ]
            }
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if field in props:
                props[field] = {"type": "integer", "minimum": 1, "maximum": 4}
        if "n" in props:
            props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
    # Chat's max_tokens default is "the rest of the context": too slow for fuzzing.
    schemas["ChatCompletionRequest"].setdefault("required", []).append("max_tokens")
    schemas["ResponsesRequest"].setdefault("required", []).append("max_output_tokens")
    return raw


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages",
                                  "/v1/responses"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(server, path, mode):
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    with server.http() as http:
        raw = http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(_narrowed_schema(raw, server.model_name()))
    operation = schema[path]["POST"]
    generation_mode = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=generation_mode))
    def fuzz(case):
        response = case.call(base_url=server.base_url, timeout=60)
        assert response.status_code < 500, f"{response.status_code}: {response.text}"
        case.validate_response(response, checks=[not_a_server_error])

    fuzz()
    with server.http() as http:
        assert http.get("/health").status_code == 200
