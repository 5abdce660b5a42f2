"""trellm serve through the official `openai` and `anthropic` client libraries.

Usage: clients.py BASE_URL MODEL EXPECTED_GREEDY_TEXT
Exits non-zero (an AssertionError or a client exception) on the first failure.
"""
import sys

import anthropic
import openai

base, model, expected = sys.argv[1], sys.argv[2], sys.argv[3]
oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
question = [{"role": "user", "content": "What is the capital of France?"}]

# /v1/models, in each API's shapes (Anthropic's clients send anthropic-version).
assert [m.id for m in oa.models.list().data] == [model]
assert oa.models.retrieve(model).id == model
assert [m.id for m in an.models.list().data] == [model]
am = an.models.retrieve(model)
assert am.id == model and am.type == "model" and am.created_at.year >= 2024, am
for call, exc in [(lambda: oa.models.retrieve("nope"), openai.NotFoundError),
                  (lambda: an.models.retrieve("nope"), anthropic.NotFoundError)]:
    try:
        call()
        raise AssertionError("no error for an unknown model")
    except exc:
        pass

# Greedy chat equals `trellm generate` for the same messages.
r = oa.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0)
c = r.choices[0]
assert c.message.role == "assistant"
assert c.message.content == expected, (c.message.content, expected)
assert c.finish_reason in ("stop", "length")
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

# chat_template_kwargs go to the template (SmolLM2's reads none of them: the same prompt).
k = oa.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0,
                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
assert k.choices[0].message.content == expected, (k.choices[0].message.content, expected)

# Fields that tune OpenAI's service or reasoning models are accepted and change nothing.
k = oa.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0,
                               service_tier="auto", prompt_cache_key="k", safety_identifier="u",
                               reasoning_effort="low", verbosity="low", modalities=["text"],
                               prompt_cache_retention="24h")
assert k.choices[0].message.content == expected, (k.choices[0].message.content, expected)

# Streaming: a role chunk, deltas, a finish chunk, a usage chunk, [DONE] (the client stops there).
chunks = list(oa.chat.completions.create(
    model=model, messages=question, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True}))
assert chunks[0].choices[0].delta.role == "assistant"
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert text == expected, (text, expected)
finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
assert finish == [c.finish_reason], finish
assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
# The same prompt again: its full KV blocks came from the prefix cache.
assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, chunks[-1].usage

# n choices, seeds: the same seed gives the same text; logprobs.
kw = dict(model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
          temperature=0.9, seed=42)
a = oa.chat.completions.create(n=2, **kw)
b = oa.chat.completions.create(n=2, **kw)
assert len(a.choices) == 2 and [x.index for x in a.choices] == [0, 1]
assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
lp = oa.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0,
                                logprobs=True, top_logprobs=3)
toks = lp.choices[0].logprobs.content
assert len(toks) == lp.usage.completion_tokens
assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in toks)
assert toks[0].logprob == max(x.logprob for x in toks[0].top_logprobs)

# Stop strings: not in the text, finish_reason "stop".
s = oa.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0,
                               stop=[" Paris"])
assert "Paris" not in s.choices[0].message.content and s.choices[0].finish_reason == "stop"
assert expected.startswith(s.choices[0].message.content)

# Completions, plain and streamed.
p = oa.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                          temperature=0, logprobs=2)
assert p.choices[0].text and len(p.choices[0].logprobs.tokens) == p.usage.completion_tokens
ps = "".join(ch.choices[0].text for ch in oa.completions.create(
    model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True)
    if ch.choices)
assert ps == p.choices[0].text, (ps, p.choices[0].text)

# A batch of prompts (texts, or token lists), n each: choices prompt by prompt, each as alone.
other = "Water boils at"
alone = oa.completions.create(model=model, prompt=other, max_tokens=8, temperature=0)
bb = oa.completions.create(model=model, prompt=["The capital of France is", other], n=2,
                           max_tokens=8, temperature=0, echo=True)
assert [c.index for c in bb.choices] == [0, 1, 2, 3], bb.choices
texts = [c.text for c in bb.choices]
want = ["The capital of France is" + p.choices[0].text] * 2 + [other + alone.choices[0].text] * 2
assert texts == want, (texts, want)
assert bb.usage.prompt_tokens == p.usage.prompt_tokens + alone.usage.prompt_tokens, bb.usage
streamed = {}
for ch in oa.completions.create(model=model, prompt=[[1, 504, 3458], [1, 504]], max_tokens=4,
                                temperature=0, stream=True):
    for c in ch.choices:
        streamed[c.index] = streamed.get(c.index, "") + c.text
assert sorted(streamed) == [0, 1], streamed

# Errors arrive as the client's own exception types.
for bad, exc in [
    (dict(model="no-such-model"), openai.NotFoundError),
    (dict(temperature=-1), openai.BadRequestError),
    (dict(max_tokens=10**7), openai.BadRequestError),
    (dict(messages=[]), openai.BadRequestError),
    (dict(extra_body={"chat_template_kwargs": {"messages": []}}), openai.BadRequestError),
]:
    args = dict(model=model, messages=question, max_tokens=4)
    args.update(bad)
    try:
        oa.chat.completions.create(**args)
        raise AssertionError(f"no error for {bad}")
    except exc as e:
        assert e.status_code in (400, 404), e

# Anthropic: messages, streamed messages, token counts, errors. (This client takes sampling
# fields such as temperature only through extra_body.)
greedy = {"temperature": 0}
m = an.messages.create(model=model, max_tokens=24, messages=question, extra_body=greedy)
assert m.content[0].type == "text" and m.content[0].text == expected, (m.content, expected)
assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
assert m.usage.cache_read_input_tokens > 0, m.usage
with an.messages.stream(model=model, max_tokens=24, messages=question, extra_body=greedy) as st:
    streamed = "".join(st.text_stream)
    final = st.get_final_message()
assert streamed == expected and final.stop_reason == m.stop_reason
sq = an.messages.create(model=model, max_tokens=24, messages=question, extra_body=greedy,
                        stop_sequences=[" Paris"])
assert sq.stop_reason == "stop_sequence" and sq.stop_sequence == " Paris"
n = an.messages.count_tokens(model=model, messages=question)
assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
try:
    an.messages.create(model=model, max_tokens=0, messages=question)
    raise AssertionError("no error for max_tokens=0")
except anthropic.BadRequestError:
    pass
try:
    an.messages.create(model="no-such-model", max_tokens=4, messages=question)
    raise AssertionError("no error for an unknown model")
except anthropic.NotFoundError:
    pass
print("ok")
