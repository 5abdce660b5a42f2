"""Tool use through the official `anthropic` client: tool_choice any / tool / auto / none,
tool_use blocks (plain and streamed, the input assembled by the client's stream helper), a
conversation carrying tool_use, tool_result and thinking blocks, count_tokens with tools,
structured output through output_config, and bad fields raised as the client's BadRequestError.

Usage: anthropic_tools.py BASE_URL MODEL
Exits non-zero (an AssertionError or a client exception) on the first failure.
"""
import json
import sys

import anthropic

base, model = sys.argv[1], sys.argv[2]
an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)

weather = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
clock = {"name": "get_time", "description": "Current time in a time zone",
         "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                          "required": ["zone"]}}
q = [{"role": "user", "content": "What is the weather like in Paris?"}]
greedy = {"temperature": 0}  # the client no longer has a temperature argument


def check_weather(block):
    assert block.type == "tool_use" and block.id.startswith("toolu_"), block
    assert block.name == "get_weather", block
    assert set(block.input) == {"city", "unit"} and isinstance(block.input["city"], str), block
    assert block.input["unit"] in ("celsius", "fahrenheit"), block


# "any": some tool is called; the message ends for it.
m = an.messages.create(model=model, max_tokens=60, extra_body=greedy, messages=q,
                       tools=[weather, clock], tool_choice={"type": "any"})
assert m.stop_reason == "tool_use", m
uses = [b for b in m.content if b.type == "tool_use"]
assert len(uses) == 1 and uses[0].name in ("get_weather", "get_time"), m.content
assert isinstance(uses[0].input, dict)

# A named tool: that one, its input matching the schema.
m = an.messages.create(model=model, max_tokens=60, extra_body=greedy, messages=q,
                       tools=[weather, clock], tool_choice={"type": "tool", "name": "get_weather"})
assert m.stop_reason == "tool_use", m
check_weather([b for b in m.content if b.type == "tool_use"][0])

# Streamed: the client's helper rebuilds the input from input_json_delta events.
with an.messages.stream(model=model, max_tokens=60, extra_body=greedy, messages=q, tools=[weather],
                        tool_choice={"type": "tool", "name": "get_weather"}) as st:
    events = [e.type for e in st]
    final = st.get_final_message()
assert "input_json" in events and events[-1] == "message_stop", events
assert final.stop_reason == "tool_use", final
check_weather([b for b in final.content if b.type == "tool_use"][0])

# "none" and no tools: plain text.
for kw in [dict(tools=[weather], tool_choice={"type": "none"}), {}]:
    m = an.messages.create(model=model, max_tokens=8, extra_body=greedy, messages=q, **kw)
    assert [b.type for b in m.content] == ["text"] and m.stop_reason in ("end_turn", "max_tokens"), m

# A past call, its result, and a thinking block from an earlier turn are read back.
history = q + [
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants the weather.", "signature": "x"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris", "unit": "celsius"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": '{"temperature": 18, "sky": "clear"}'}]},
        {"type": "text", "text": "Answer in one sentence."}]},
]
h = an.messages.create(model=model, max_tokens=24, extra_body=greedy, messages=history, tools=[weather])
assert h.content and h.stop_reason in ("end_turn", "max_tokens", "tool_use"), h
plain = an.messages.count_tokens(model=model, messages=q).input_tokens
with_tools = an.messages.count_tokens(model=model, messages=q, tools=[weather]).input_tokens
assert with_tools > plain > 0, (with_tools, plain)
assert an.messages.count_tokens(model=model, messages=history, tools=[weather]).input_tokens > with_tools

# Structured output (output_config.format), with the fields such clients send beside it.
city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}
m = an.messages.create(model=model, max_tokens=40, extra_body=greedy,
                       messages=[{"role": "user", "content": "Name a big city."}],
                       output_config={"format": {"type": "json_schema", "schema": city}, "effort": "low"},
                       thinking={"type": "disabled"}, cache_control={"type": "ephemeral"},
                       service_tier="auto", inference_geo="us", diagnostics={"previous_message_id": None})
assert m.stop_reason == "end_turn" and set(json.loads(m.content[0].text)) == {"city"}, m

# Bad tool fields and unsupported blocks: 400s.
for kw in [
    dict(tools=[weather], tool_choice={"type": "tool", "name": "nope"}),
    dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
    dict(tools=[{"name": "f"}]),
    dict(tools=[weather], tool_choice={"type": "sometimes"}),
    dict(output_config={"format": {"type": "yaml"}}),
    dict(thinking={"type": "sometimes"}),
    dict(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]),
]:
    try:
        an.messages.create(model=model, max_tokens=4, **{"messages": q, **kw})
        raise AssertionError(f"no error for {kw}")
    except anthropic.BadRequestError as e:
        assert e.status_code == 400, e
print("ok")
