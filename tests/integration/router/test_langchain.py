"""LangChain's OpenAI chat model against the router: bind_tools and with_structured_output."""

from __future__ import annotations

import pydantic
import pytest
from router_procs import key_of
from support.lazy_import import Lazy, needs

langchain_openai = Lazy("langchain_openai")
pytestmark = needs("langchain_openai")


class GetWeather(pydantic.BaseModel):
    """Weather in a city."""

    city: str = pydantic.Field(max_length=10)


class Record(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    ok: bool


def llm(router, **kw):
    return langchain_openai.ChatOpenAI(base_url=router.url + "/v1", api_key=key_of("alice"),
                                       model="tiny", temperature=0, max_tokens=80,
                                       max_retries=0, **kw)


def test_bind_tools_forced_and_required(router):
    for choice in ("GetWeather", "any"):
        msg = llm(router).bind_tools([GetWeather], tool_choice=choice).invoke("Paris weather?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "GetWeather"
        GetWeather(**msg.tool_calls[0]["args"])  # the arguments validate


# (json_mode is response_format json_object: any object, whose keys a random model never
# stops adding; test_agent_api covers it.)
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(router, method):
    out = llm(router).with_structured_output(Record, method=method).invoke("Make a record.")
    assert isinstance(out, Record)
