"""Structured output and tools through the official `openai` client: response_format
json_schema (plain and streamed) and json_object, tool calls forced by tool_choice, tool turns in
the input, the client's pydantic `parse` helpers, and bad schemas raised as the client's
BadRequestError.

Usage: structured.py BASE_URL MODEL
Exits non-zero (an AssertionError or a client exception) on the first failure.
"""
import json
import sys
from typing import Literal

import openai
import pydantic

base, model = sys.argv[1], sys.argv[2]
oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

CITIES = ["Paris", "London", "Tokyo"]
person = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": CITIES},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def check_person(text):
    """Validates against `person` by hand (the test venv has only the API clients and their
    dependencies)."""
    v = json.loads(text)
    assert isinstance(v, dict) and set(v) == {"name", "age", "city"}, v
    assert isinstance(v["name"], str) and 1 <= len(v["name"]) <= 24, v
    assert isinstance(v["age"], int) and not isinstance(v["age"], bool), v
    assert 0 <= v["age"] <= 120 and v["city"] in CITIES, v


ask = [{"role": "user", "content": "Describe a person who lives in a big city."}]
fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}

# json_schema: the output validates; the grammar ends it, so finish_reason is "stop".
r = oa.chat.completions.create(model=model, messages=ask, max_tokens=60, temperature=0.7,
                               seed=1, response_format=fmt)
check_person(r.choices[0].message.content)
assert r.choices[0].finish_reason == "stop", r.choices[0]

# Streamed, the deltas join into the same kind of document.
chunks = list(oa.chat.completions.create(model=model, messages=ask, max_tokens=60,
                                         temperature=0.7, seed=2, response_format=fmt,
                                         stream=True))
check_person("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"

# json_object: any JSON object.
o = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
                               max_tokens=80, temperature=0, response_format={"type": "json_object"})
if o.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(o.choices[0].message.content), dict), o.choices[0]
else:
    assert o.choices[0].message.content.startswith("{"), o.choices[0]

# Tools: tool_choice "required" forces a well-formed call whose arguments match the schema.
weather = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
clock = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}
q = [{"role": "user", "content": "What is the weather like in Paris?"}]


def check_weather_call(call):
    assert call.type == "function" and call.id, call
    assert call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str), args
    assert args["unit"] in ("celsius", "fahrenheit"), args


t = oa.chat.completions.create(model=model, messages=q, tools=[weather, clock],
                               tool_choice="required", max_tokens=60, temperature=0)
c = t.choices[0]
assert c.finish_reason == "tool_calls", c
assert len(c.message.tool_calls) == 1, c.message
call = c.message.tool_calls[0]
assert call.function.name in ("get_weather", "get_time"), call
json.loads(call.function.arguments)

# A named function: that one is called.
t = oa.chat.completions.create(model=model, messages=q, tools=[weather, clock], max_tokens=60,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}},
                               temperature=0)
assert t.choices[0].finish_reason == "tool_calls"
check_weather_call(t.choices[0].message.tool_calls[0])

# Streamed: the call arrives as a tool_calls delta, then finish_reason "tool_calls".
chunks = list(oa.chat.completions.create(
    model=model, messages=q, tools=[weather], tool_choice="required", max_tokens=60,
    temperature=0, stream=True))
deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
assert len(deltas) == 1 and deltas[0].index == 0, deltas
check_weather_call(deltas[0])
assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"

# A conversation with a past call and its result is accepted and rendered.
history = q + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18, "sky": "clear"})},
]
h = oa.chat.completions.create(model=model, messages=history, tools=[weather], max_tokens=24,
                               temperature=0)
assert h.choices[0].message.content or h.choices[0].message.tool_calls, h.choices[0]

# The client's pydantic helpers: `parse` sends the model's strict schema and reads the reply back
# into it (chat, streamed chat and the Responses API), and `pydantic_function_tool` calls come back
# with `parsed_arguments`.
class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    city: Literal["Paris", "London", "Tokyo"]


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


p = oa.chat.completions.parse(model=model, messages=ask, response_format=Person, max_tokens=60,
                              temperature=0)
assert isinstance(p.choices[0].message.parsed, Person), p.choices[0]
with oa.chat.completions.stream(model=model, messages=ask, response_format=Person, max_tokens=60,
                                temperature=0.7, seed=3) as stream:
    for _ in stream:
        pass
    assert isinstance(stream.get_final_completion().choices[0].message.parsed, Person)
rp = oa.responses.parse(model=model, input=ask[0]["content"], text_format=Person,
                        max_output_tokens=60, temperature=0)
assert isinstance(rp.output_parsed, Person), rp
assert rp.output_parsed == p.choices[0].message.parsed, (rp.output_parsed, p.choices[0].message.parsed)
t = oa.chat.completions.parse(model=model, messages=q, tools=[openai.pydantic_function_tool(GetWeather)],
                              tool_choice="required", max_tokens=60, temperature=0)
call = t.choices[0].message.tool_calls[0]
assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather), call

# Bad schemas and tool fields are the client's BadRequestError, naming the field.
for kw, param in [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}), "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(modalities=["text", "audio"]), "modalities"),
    (dict(tools=[weather], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
          tool_choice="required"), "tools"),
]:
    try:
        oa.chat.completions.create(model=model, messages=q, max_tokens=4, **kw)
        raise AssertionError(f"no error for {kw}")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.param == param, (kw, e.param, e)
print("ok")
