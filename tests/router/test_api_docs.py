"""docs/api.md cannot drift from the code: every route and every body field is named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helexa.router import anthropic, request_model, responses_api, responses_input, tokenize
from helexa.router.app import RouterState, build_app

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
STRUCTS = [request_model.ChatBody, request_model.CompletionBody, request_model.Message,
           request_model.ResponseFormat, request_model.JsonSchemaFormat,
           anthropic.MessagesBody, anthropic.Block, anthropic.AToolChoice, anthropic.AThinking,
           anthropic.AOutputConfig, anthropic.CountTokensBody, tokenize.TokenizeBody,
           tokenize.DetokenizeBody, responses_api.ResponsesBody, responses_input.Item,
           responses_input.Part,
           responses_api.RTool, responses_api.Reasoning, responses_api.TextFormat,
           responses_api.TextConfig]


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_every_body_field_is_documented(struct):
    missing = [f for f in struct.__struct_fields__ if f"`{f}`" not in DOC]
    assert not missing, f"docs/api.md does not name {struct.__name__} fields {missing}"


def test_every_route_is_documented():
    from helexa.config.schema import RouterConfig

    app = build_app(RouterState(RouterConfig(), None))
    documented = set(re.findall(r"`(?:GET|POST) (/[^` ]*)`", DOC)) | {
        p for m in re.finditer(r"`GET (/[^`]+)`, `GET (/[^`]+)`", DOC) for p in m.groups()}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource else ""
        path = re.sub(r"\{model:[^}]*\}", "{model}", path)
        if route.method == "HEAD":
            continue
        assert path in documented, f"docs/api.md does not list {route.method} {path}"
