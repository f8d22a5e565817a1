"""openai-agents' default model (the Responses API) runs an agent loop on the tiny model:
a forced tool call, the tool's output sent back, then a final answer of its output type
(a schema: the random-weight model ends a JSON object, where free text might run on until
max_tokens, which openai-agents takes as a failed response, as it would from OpenAI);
streamed too."""

from __future__ import annotations

import asyncio
from typing import Annotated

import pydantic
from router_procs import key_of
from support.lazy_import import Lazy, needs

agents = Lazy("agents")
pytestmark = needs("agents", " (openai-agents, a test-only dependency: the dev extra)")


class Report(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    sunny: bool


def _agent(router):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    client = AsyncOpenAI(base_url=router.url + "/v1", api_key=key_of("alice"), max_retries=0)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=10)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = agents.Agent(
        name="weather", instructions="Answer about the weather.", tools=[get_weather],
        output_type=Report,
        model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
        # the first turn must call the tool; openai-agents then resets the choice to auto
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=60,
                                            temperature=0.0))
    return agent, calls


def test_an_agent_calls_its_tool_and_answers(router):
    agent, calls = _agent(router)
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=4)
    assert len(calls) == 1 and isinstance(calls[0], str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert isinstance(result.final_output, Report) and len(result.final_output.city) <= 10
    assert result.context_wrapper.usage.requests == 2


def test_an_agent_run_streamed(router):
    agent, calls = _agent(router)

    async def go():
        run = agents.Runner.run_streamed(agent, "Weather in Oslo?", max_turns=4)
        kinds = [e.type async for e in run.stream_events()]
        return run, kinds

    run, kinds = asyncio.run(go())
    assert len(calls) == 1 and "raw_response_event" in kinds
    assert isinstance(run.final_output, Report)
