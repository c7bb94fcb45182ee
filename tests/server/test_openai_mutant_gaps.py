"""What `specdec openai` makes of the server's chunks, and the guide limits, without a server.

The served tests (test_openai.py, test_openai_tools.py, test_structured.py) compare the front
end with the ensemble on the real model; on a greedy, well-behaved answer several of its bugs
do not show (the emitted token is the likeliest, so its own log prob equals the top one; the
ids streamed equal the server's count). The mutants of tests/support/mutants/openai_and_guides.toml
found those gaps. Here the front end's request path runs on scripted chunks (a stand-in for
Triton's stream and a stand-in tokenizer) through the real FastAPI app, so each shape is
pinned on an answer where it matters: a sampled token that is not the likeliest, a non-ASCII
token, a step streamed without its ids, a cut tool call, a tag split across chunks. The guide
limits are checked where they are enforced: the request's size check, the served limit it is
given, and the compile-time limit's probe."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import specdec_wire as P
from specdec_client.client import Chunk
from specdec_openai.frontend import Served, create_app

# id -> text: " café" is non-ASCII (its UTF-8 bytes are not its code points)
TOKENS = {0: "Hi", 1: " there", 2: " café", 3: "!", 4: " world"}
MODEL = "m"
ASK = [{"role": "user", "content": "Say hi."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class Tokenizer:
    """The target's chat template, token counts and token texts, stood in."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return type("Encoding", (), {"input_ids": text.split()})()

    def decode(self, ids):
        return "".join(TOKENS[i] for i in ids)


class Scripted:
    """The Frontend's interface, with each request's chunks from `script(job)`."""

    def __init__(self, script):
        self.served = Served(MODEL, {MODEL: "", f"{MODEL}:none": "none"})
        self.tokenizer = Tokenizer()
        self.script = script
        self.jobs = []

    async def ready(self) -> bool:
        return True

    async def chunks(self, job):
        self.jobs.append(job)
        for chunk in self.script(job):
            await asyncio.sleep(0)
            yield chunk


def chunk(text: str, ids=(), reason=None, perf=None, log_probs=(), top=()) -> Chunk:
    return Chunk(text, 0.0, dict(perf or {}), list(ids), reason, list(log_probs), [list(row) for row in top])


def post(frontend: Scripted, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=create_app(frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await client.post(path, json=body)
    response = asyncio.run(go())
    assert response.status_code == 200, response.text
    return response


def events(response: httpx.Response) -> list[dict]:
    datas = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


# ---- log probs ---------------------------------------------------------------------------------
def sampled(job):
    """A sampled answer: " café" drawn although " there" is likelier; 3 alternatives per row
    (the top_logprobs the request asked the server for)."""
    yield chunk("Hi", [0], log_probs=[-0.1], top=[[(0, -0.1), (1, -2.5), (3, -3.0)]])
    yield chunk(" café", [2], log_probs=[-1.5], top=[[(1, -0.4), (2, -1.5), (4, -2.0)]], reason="length",
                perf={P.OUTPUT_TOKENS: 2})


def test_chat_log_probs_are_the_emitted_tokens_own_with_utf8_bytes_and_top_logprobs_alternatives():
    body = dict(model=MODEL, messages=ASK, max_tokens=2, logprobs=True, top_logprobs=3)
    for stream in (False, True):
        response = post(Scripted(sampled), dict(body, stream=stream))
        if stream:
            content = [e for ev in events(response) for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
        else:
            content = response.json()["choices"][0]["logprobs"]["content"]
        assert [(e["token"], e["logprob"]) for e in content] == [("Hi", -0.1), (" café", -1.5)], stream  # its own, not the likeliest's
        assert content[1]["bytes"] == list(" café".encode("utf-8")) == [32, 99, 97, 102, 195, 169]
        assert [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in content] == [
            [("Hi", -0.1), (" there", -2.5), ("!", -3.0)], [(" there", -0.4), (" café", -1.5), (" world", -2.0)]], stream
        assert all(t["bytes"] == list(t["token"].encode("utf-8")) for e in content for t in e["top_logprobs"])


def test_completions_log_probs_in_the_legacy_shape():
    out = post(Scripted(sampled), dict(model=MODEL, prompt="Say hi.", max_tokens=2, logprobs=2), "/v1/completions").json()
    logprobs = out["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hi", " café"] and logprobs["token_logprobs"] == [-0.1, -1.5]
    assert logprobs["top_logprobs"] == [{"Hi": -0.1, " there": -2.5}, {" there": -0.4, " café": -1.5}]
    assert logprobs["text_offset"] == [0, 2]


# ---- finish_reason and usage -------------------------------------------------------------------
@pytest.mark.parametrize("server_reason, reason", [("length", "length"), ("stop", "stop"), ("eos", "stop")])
def test_finish_reason_streamed_or_not(server_reason, reason):
    def script(job):
        yield chunk("Hi", [0])
        yield chunk(" world", [4], reason=server_reason, perf={P.OUTPUT_TOKENS: 2})

    body = dict(model=MODEL, messages=ASK, max_tokens=2)
    out = post(Scripted(script), body).json()
    assert out["choices"][0]["finish_reason"] == reason and out["choices"][0]["message"]["content"] == "Hi world"
    streamed = events(post(Scripted(script), dict(body, stream=True)))
    assert [c["finish_reason"] for ev in streamed for c in ev["choices"] if c["finish_reason"]] == [reason]
    # the last chunk's text (it comes with the reason) is streamed too
    assert "".join(c["delta"].get("content") or "" for ev in streamed for c in ev["choices"]) == "Hi world"


def test_usage_is_the_servers_token_count_and_the_prompt_and_every_choice():
    """A step whose text was held back for a possible stop string streamed no chunk: the
    server's output_tokens (3) counts it, the ids streamed (2) do not."""
    def script(job):
        yield chunk("Hi", [0])
        yield chunk(" world", [4], reason="stop", perf={P.OUTPUT_TOKENS: 3, P.NUM_CACHED_TOKENS: 1})

    prompt_tokens = len(Tokenizer().apply_chat_template(ASK, True, False).split())
    body = dict(model=MODEL, messages=ASK, max_tokens=8)
    usage = post(Scripted(script), body).json()["usage"]
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3,
                     "prompt_tokens_details": {"cached_tokens": 1}}
    assert post(Scripted(script), dict(body, n=2)).json()["usage"]["completion_tokens"] == 6  # both choices
    streamed = events(post(Scripted(script), dict(body, n=2, stream=True, stream_options={"include_usage": True})))
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 6
    assert streamed[-1]["usage"]["total_tokens"] == prompt_tokens + 6


def test_max_tokens_reaches_the_server():
    frontend = Scripted(lambda job: [chunk("Hi", [0], reason="length", perf={P.OUTPUT_TOKENS: 1})])
    post(frontend, dict(model=MODEL, messages=ASK, max_completion_tokens=7, max_tokens=99))
    post(frontend, dict(model=MODEL, messages=ASK, max_tokens=5))
    post(frontend, dict(model=MODEL, messages=ASK))
    assert [job.max_tokens for job in frontend.jobs] == [7, 5, 256]
    from specdec_openai.frontend import Frontend

    triton = Frontend("127.0.0.1:9", frontend.served, frontend.tokenizer)
    assert [triton.request(job).max_tokens for job in frontend.jobs] == [7, 5, 256]  # the Triton request's


# ---- n > 1 -------------------------------------------------------------------------------------
def per_seed(job):
    """Each draw's text follows its seed (what a sampled answer does)."""
    yield chunk(f"draw {job.seed}", [0], reason="stop", perf={P.OUTPUT_TOKENS: 1})


@pytest.mark.parametrize("in_turn", [False, True])
def test_n_choices_are_each_seeded_seed_plus_index(in_turn):
    body = dict(model=MODEL, messages=ASK, max_tokens=4, n=3, seed=5, siblings_in_turn=in_turn)
    frontend = Scripted(per_seed)
    out = post(frontend, body).json()
    assert [(c["index"], c["message"]["content"]) for c in out["choices"]] == [(0, "draw 5"), (1, "draw 6"), (2, "draw 7")]
    assert sorted(job.seed for job in frontend.jobs) == [5, 6, 7] and all(job.n == 1 for job in frontend.jobs)
    streamed = events(post(Scripted(per_seed), dict(body, stream=True)))
    texts = ["".join(c["delta"].get("content") or "" for ev in streamed for c in ev["choices"] if c["index"] == i) for i in range(3)]
    assert texts == ["draw 5", "draw 6", "draw 7"]


# ---- tool calls --------------------------------------------------------------------------------
def test_a_streamed_call_tag_is_held_back_even_split_after_its_first_character():
    """The call block's tag arrives split after "<": nothing of it leaks as content, the call
    comes as one tool_calls delta, and the reason is tool_calls."""
    def script(job):
        yield chunk("Let me check.\n<", [0])
        yield chunk(CALL[1:20], [0])
        yield chunk(CALL[20:], [0], reason="stop", perf={P.OUTPUT_TOKENS: 3})

    streamed = events(post(Scripted(script), dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, stream=True)))
    content = "".join(c["delta"].get("content") or "" for ev in streamed for c in ev["choices"])
    assert content.strip() == "Let me check." and "<" not in content
    calls = [tc for ev in streamed for c in ev["choices"] for tc in c["delta"].get("tool_calls") or []]
    assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] == [("get_weather", {"city": "Oslo"})]
    assert [c["finish_reason"] for ev in streamed for c in ev["choices"] if c["finish_reason"]] == ["tool_calls"]
    from specdec_openai.tool_calls import held_back

    assert [held_back(text) for text in ("Sure <", "Sure <t", "Sure <tool_call", "Sure <b>")] == [1, 2, 10, 0]


@pytest.mark.parametrize("tool_choice, server_reason, reason", [
    ("required", "stop", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop", "stop"),
    ("required", "length", "length"), ({"type": "function", "function": {"name": "get_weather"}}, "length", "length"),
])
def test_a_forced_call_is_grammar_guided_and_its_finish_reason(tool_choice, server_reason, reason):
    """A forced call's request carries the call grammar; a call cut by max_tokens is "length"
    (OpenAI's), a named one "stop", a required one "tool_calls"."""
    frontend = Scripted(lambda job: [chunk(CALL, [0], reason=server_reason, perf={P.OUTPUT_TOKENS: 1})])
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=64)
    choice = post(frontend, body).json()["choices"][0]
    assert choice["finish_reason"] == reason and choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert frontend.jobs[0].guide_type == "ebnf_grammar" and "<tool_call>" in frontend.jobs[0].guide
    streamed = events(post(frontend, dict(body, stream=True)))
    assert [c["finish_reason"] for ev in streamed for c in ev["choices"] if c["finish_reason"]] == [reason]


def test_the_call_grammar_requires_the_arguments_and_the_tools_required_parameters():
    import xgrammar as xgr

    from specdec_openai.tool_calls import call_grammar, tool_plan

    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(call_grammar(tool_plan({"tools": TOOLS, "tool_choice": choice}))))

        def accepts(call: str) -> bool:
            matcher = xgr.GrammarMatcher(compiled)
            return matcher.accept_string(f"<tool_call>\n{call}\n</tool_call>") and matcher.accept_token(len(vocab) - 1) \
                and matcher.is_terminated()

        assert accepts('{"name": "get_weather", "arguments": {"city": "Oslo"}}'), choice
        assert not accepts('{"name": "get_weather", "arguments": {}}'), choice  # city is required
        assert not accepts('{"name": "get_weather"}'), choice  # so are the arguments


# ---- guide limits ------------------------------------------------------------------------------
def test_the_guide_size_limit_is_in_utf8_bytes_and_inclusive():
    from specdec.config import check_guide
    from specdec.errors import InvalidRequestError

    check_guide("regex", "a" * 100, max_bytes=100)
    check_guide("regex", "é" * 50, max_bytes=100)  # 100 bytes
    for guide in ("a" * 101, "é" * 51, "é" * 60):  # 60 characters, 120 bytes
        with pytest.raises(InvalidRequestError, match=P.GUIDED_DECODING_GUIDE):
            check_guide("regex", guide, max_bytes=100)
    check_guide("regex", "a" * 10_000)  # no limit given: none applied


def test_the_served_guide_size_limit_is_the_configured_one():
    """engine.max_guide_bytes reaches the request check, below and above the default 64 KiB."""
    import dataclasses

    from specdec.config import SERVED_SETTINGS, SamplingParams, ServingConfig
    from specdec.errors import InvalidRequestError
    from specdec.serving.request import served_offer, validate_request

    settings = ServingConfig.from_file(SERVED_SETTINGS)
    for limit in (100, 200 * 1024):
        offer = served_offer(dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, max_guide_bytes=limit)))
        assert offer.max_guide_bytes == limit
        validate_request(None, SamplingParams(max_tokens=4, guide_type="regex", guide="a" * limit), None, None, offer)
        with pytest.raises(InvalidRequestError, match=P.GUIDED_DECODING_GUIDE):
            validate_request(None, SamplingParams(max_tokens=4, guide_type="regex", guide="a" * (limit + 1)), None, None, offer)


def test_a_guide_past_the_compile_time_limit_is_refused_and_remembered(smol_tokenizer):
    """The probe process is stopped at the limit and the request refused naming the guide,
    nothing of it compiled in process; a repeat is refused from memory, without compiling again."""
    import xgrammar as xgr

    from specdec.engine.guide_compiler import GuideCompiler
    from specdec.errors import InvalidRequestError

    info = xgr.TokenizerInfo.from_huggingface(smol_tokenizer, vocab_size=len(smol_tokenizer))
    compiled = []
    worker = GuideCompiler(lambda kind, guide: compiled.append(guide) or guide, info.serialize_json, timeout_s=0.05)
    try:
        worker.warm()  # the probe started, as a server starts it
        hostile = "[a-z]{0,4000}"  # ~0.3 s to compile on this vocabulary
        for _ in range(2):
            with pytest.raises(InvalidRequestError, match="guide_compile_timeout_s") as err:
                worker.submit("regex", hostile).result(120)
            assert err.value.field == P.GUIDED_DECODING_GUIDE
            assert worker.kills == 1  # the repeat is refused from memory, nothing compiled again
        assert compiled == []
    finally:
        worker.close()
