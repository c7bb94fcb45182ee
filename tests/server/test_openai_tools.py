"""Tools through `specdec openai` against the real Triton server, driven with the OpenAI SDK
and LangChain: forced calls (required, named) valid against their schemas and identical with
and without speculation for every served method, streamed tool_calls deltas, auto parsed,
and agent loops (call, tool result, call, tool result, answer)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from test_openai import BASE, api, sdk  # noqa: F401 - fixtures

pytestmark = pytest.mark.server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The current time in a timezone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_validate_and_equal_the_baseline_for_every_method(sdk, tool_choice):
    args = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=64, temperature=0)
    base = sdk.chat.completions.create(model=f"{BASE}:none", **args)
    calls = calls_of(base.choices[0].message)
    assert calls and not base.choices[0].message.content, base.choices[0].message
    if isinstance(tool_choice, dict):
        assert calls[0][0] == "get_time" and len(calls) == 1 and base.choices[0].finish_reason == "stop"  # OpenAI's, named
    else:
        assert len(calls) == 1 and base.choices[0].finish_reason == "tool_calls"  # one (parallel_tool_calls not sent)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    methods = [m.id for m in sdk.models.list() if m.id.startswith(f"{BASE}:") and m.id != f"{BASE}:none"]
    for model in methods:
        spec = sdk.chat.completions.create(model=model, **args)
        assert calls_of(spec.choices[0].message) == calls, model
        assert spec.model_extra["specdec"]["draft_tokens"] > 0, model
    # streamed: the SDK's tool_calls deltas add up to the same call
    chunks = list(sdk.chat.completions.create(model=f"{BASE}:eagle3", stream=True, **args))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert [(d.function.name, d.function.arguments) for d in deltas] == calls and deltas[0].id.startswith("call_")
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # no tag text leaks as content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [base.choices[0].finish_reason]


def test_auto_is_parsed_and_equal_with_and_without_speculation(sdk):
    args = dict(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0)
    base = sdk.chat.completions.create(model=f"{BASE}:none", **args)
    for model in (f"{BASE}:ngram", f"{BASE}:eagle3"):
        spec = sdk.chat.completions.create(model=model, **args)
        assert (spec.choices[0].message.content, calls_of(spec.choices[0].message)) == (
            base.choices[0].message.content, calls_of(base.choices[0].message)), model
    assert "<tool_call>" not in (base.choices[0].message.content or "")
    streamed = list(sdk.chat.completions.create(model=f"{BASE}:eagle3", stream=True, **args))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) or None
    assert (text or "").strip() == (base.choices[0].message.content or "").strip()


def test_an_agent_loop_with_two_tool_calls_through_the_sdk(sdk):
    """Call, tool result, call, tool result, final answer: the second call and the answer are
    asked with the first call and its result in the conversation (the template renders them)."""
    messages = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
    results = {"get_weather": {"temperature": 18, "sky": "clear"}, "get_time": {"time": "14:05"}}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "get_time"}}):
        out = sdk.chat.completions.create(model=f"{BASE}:eagle3", messages=messages, tools=TOOLS, tool_choice=choice,
                                          max_tokens=64, temperature=0)
        message = out.choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == choice["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(results[call.function.name])})
    final = sdk.chat.completions.create(model=f"{BASE}:eagle3", messages=messages, tools=TOOLS, tool_choice="none",
                                        max_tokens=48, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    base = sdk.chat.completions.create(model=f"{BASE}:none", messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=48, temperature=0)
    assert final.choices[0].message.content == base.choices[0].message.content


def test_an_agent_loop_through_langchain(api):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({"city": city, "temperature": 18})

    @tool
    def get_time(timezone: str) -> str:
        """The current time in a timezone."""
        return json.dumps({"timezone": timezone, "time": "14:05"})

    llm = ChatOpenAI(base_url=api + "/v1", api_key="unused", model=f"{BASE}:ngram", temperature=0, max_tokens=64, max_retries=0)
    messages = [HumanMessage("What is the weather in Paris, and what time is it there?")]
    for chosen in (get_weather, get_time):
        reply = llm.bind_tools([get_weather, get_time], tool_choice=chosen.name).invoke(messages)
        (call,) = reply.tool_calls
        assert call["name"] == chosen.name and isinstance(call["args"], dict)
        messages += [reply, ToolMessage(chosen.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather, get_time], tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
