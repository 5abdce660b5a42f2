"""The Responses API (`/v1/responses`) through the official `openai` client: plain and streamed
text (the stream helper's events and final response), function tools forced by tool_choice
(plain and streamed), a conversation carrying a call and its output, text.format json_schema,
and what a stateless server refuses raised as the client's BadRequestError.

Usage: responses.py BASE_URL MODEL EXPECTED_GREEDY_TEXT
Exits non-zero (an AssertionError or a client exception) on the first failure.
"""
import json
import sys

import openai

base, model, expected = sys.argv[1], sys.argv[2], sys.argv[3]
oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
question = "What is the capital of France?"

# Greedy text equals the chat endpoint's (and `trellm generate`'s) for the same message.
r = oa.responses.create(model=model, input=question, max_output_tokens=24, temperature=0)
assert r.object == "response" and r.id.startswith("resp_"), r
assert r.output_text == expected, (r.output_text, expected)
assert r.status in ("completed", "incomplete") and r.output[0].type == "message", r
assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
if r.status == "incomplete":
    assert r.incomplete_details.reason == "max_output_tokens", r

# The same as a list of messages.
m = oa.responses.create(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
                        max_output_tokens=24, temperature=0)
assert m.output_text == expected, (m.output_text, expected)

# Streamed: numbered events in order; the helper's final response has the same text.
with oa.responses.stream(model=model, input=question, max_output_tokens=24, temperature=0) as st:
    events = list(st)
    final = st.get_final_response()
kinds = [e.type for e in events]
assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"], kinds
assert kinds[-1] == "response." + ("completed" if r.status == "completed" else "incomplete"), kinds
assert [e.sequence_number for e in events] == list(range(len(events)))
assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
assert final.output_text == expected and final.usage.output_tokens == r.usage.output_tokens

# Function tools: "required" forces a call whose arguments match the schema.
weather = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
ask = "What is the weather like in Paris?"


def check_call(item):
    assert item.type == "function_call" and item.call_id and item.name == "get_weather", item
    args = json.loads(item.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit"), args


t = oa.responses.create(model=model, input=ask, tools=[weather], tool_choice="required",
                        max_output_tokens=60, temperature=0)
calls = [o for o in t.output if o.type == "function_call"]
assert t.status == "completed" and len(calls) == 1, t.output
check_call(calls[0])
with oa.responses.stream(model=model, input=ask, tools=[weather], max_output_tokens=60, temperature=0,
                         tool_choice={"type": "function", "name": "get_weather"}) as st:
    kinds = [e.type for e in st]
    final = st.get_final_response()
assert "response.function_call_arguments.done" in kinds, kinds
check_call([o for o in final.output if o.type == "function_call"][0])

# A call and its output in the input are read back.
history = [{"role": "user", "content": ask},
           {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
            "arguments": calls[0].arguments},
           {"type": "function_call_output", "call_id": calls[0].call_id,
            "output": json.dumps({"temperature": 18, "sky": "clear"})}]
h = oa.responses.create(model=model, input=history, tools=[weather], max_output_tokens=24,
                        temperature=0, instructions="Answer briefly.")
assert h.output and h.instructions == "Answer briefly.", h

# text.format json_schema: the output follows the schema.
city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}
j = oa.responses.create(model=model, input="Name a big city.", max_output_tokens=40, temperature=0,
                        text={"format": {"type": "json_schema", "name": "city", "schema": city, "strict": True}})
assert j.status == "completed" and set(json.loads(j.output_text)) == {"city"}, j.output_text

# Refused, naming the field.
for kw, param in [
    (dict(previous_response_id="resp_123"), "previous_response_id"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(max_output_tokens=10**7), "max_output_tokens"),
    (dict(tool_choice={"type": "allowed_tools"}), "tool_choice"),
    (dict(text={"format": {"type": "yaml"}}), "text.format"),
    (dict(input=[{"type": "input_image", "image_url": "x"}]), "input"),
]:
    try:
        oa.responses.create(model=model, **{"input": question, **kw})
        raise AssertionError(f"no error for {kw}")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.param == param, (kw, e.param, e)
print("ok")
