"""The one request parser (specdec.serving.request): every entry point reads requests through it."""
from __future__ import annotations

import json

import numpy as np
import pytest

import specdec_wire as P
from specdec.triton_models import contract as C
from specdec.config import METHOD_NONE, SamplingParams
from specdec.errors import InvalidRequestError
from specdec.engine.sequences import check_prompt_ids, draft_budget
from specdec.serving.request import ServedOffer, TokenRules, parse_request, resolve_method, resolve_token_rules
from specdec.triton_models.contract import decode_generation, decode_sampling, encode_generation, encode_sampling

OFFER = ServedOffer({"eagle3": 5, "ngram": 4}, "eagle3", max_num_draft_tokens=16, max_tokens_limit=512)


def inputs(**values):
    out = {}
    for name, value in values.items():
        if isinstance(value, str):
            out[name] = np.array([value.encode()], dtype=object)
        elif isinstance(value, bool):
            out[name] = np.bool_([value])
        elif isinstance(value, float):
            out[name] = np.float32([value])
        elif isinstance(value, list):
            out[name] = np.array(value, dtype=object if value and isinstance(value[0], str) else np.int32)
        else:
            out[name] = np.int32([value])
    return out


def test_defaults_method_budget_and_baseline():
    req = parse_request(inputs(text_input="Hi", max_tokens=8), OFFER)
    assert (req.method, req.num_draft_tokens, req.params.greedy, req.apply_chat_template) == ("eagle3", 5, True, True)
    assert parse_request(inputs(text_input="Hi", max_tokens=8, speculative_method="ngram"), OFFER).num_draft_tokens == 4
    for baseline in (dict(num_draft_tokens=0), dict(speculative_method="none"), dict(speculative_method="ngram", num_draft_tokens=0)):
        req = parse_request(inputs(text_input="Hi", max_tokens=8, **baseline), OFFER)
        assert (req.method, req.num_draft_tokens) == (METHOD_NONE, 0)
    ids = parse_request({**inputs(max_tokens=8), P.INPUT_IDS: np.int32([5, 6, 7])}, OFFER)
    assert ids.prompt is None and ids.prompt_ids == (5, 6, 7)


@pytest.mark.parametrize("values, field", [
    (dict(text_input="   "), P.TEXT_INPUT),
    (dict(text_input=["a", "b"]), P.TEXT_INPUT),
    (dict(), P.TEXT_INPUT),
    (dict(text_input="Hi", max_tokens=None), P.MAX_TOKENS),
    (dict(text_input="Hi", max_tokens=0), P.MAX_TOKENS),
    (dict(text_input="Hi", max_tokens=513), P.MAX_TOKENS),
    (dict(text_input="Hi", temperature=-0.5), P.TEMPERATURE),
    (dict(text_input="Hi", temperature=1.0, top_p=0.0), P.TOP_P),
    (dict(text_input="Hi", top_k=-1), P.TOP_K),
    (dict(text_input="Hi", speculative_method="lookahead"), P.SPECULATIVE_METHOD),
    (dict(text_input="Hi", num_draft_tokens=17), P.NUM_DRAFT_TOKENS),
    (dict(text_input="Hi", num_draft_tokens=-1), P.NUM_DRAFT_TOKENS),
    (dict(text_input="Hi", random_seed=1, seed=2), P.SEED),
    (dict(text_input="Hi", temperature=1.0, min_p=1.5), P.MIN_P),
    (dict(text_input="Hi", embedding_bias_token_ids=[5, 6], embedding_bias_weights=[1.0]), P.EMBEDDING_BIAS_WEIGHTS),
    (dict(text_input="Hi", embedding_bias_token_ids=[5], embedding_bias_weights=[150.0]), P.EMBEDDING_BIAS_WEIGHTS),
    (dict(text_input="Hi", embedding_bias_words=["a"], embedding_bias_token_ids=[5], embedding_bias_weights=[1.0]),
     P.EMBEDDING_BIAS_TOKEN_IDS),
])
def test_bad_requests_name_the_field(values, field):
    values = {"max_tokens": 8, **values}
    with pytest.raises(InvalidRequestError) as err:
        parse_request(inputs(**{k: v for k, v in values.items() if v is not None}), OFFER)
    assert err.value.field == field


def test_min_p_and_the_embedding_bias_arrive_by_words_or_token_ids():
    """TensorRT-LLM's embedding_bias_words (every token of a word gets its weight, as its
    preprocessing does; an empty word is skipped with its weight) or our token ids, each with
    embedding_bias_weights; min_p as vLLM names it. They reach the verifier's record intact."""
    def tokenize_word(word):
        return [ord(c) for c in word]

    offer = ServedOffer({"ngram": 4}, "ngram", max_num_draft_tokens=16, max_tokens_limit=512,
                        tokens=TokenRules(vocab_size=256, eos_ids=frozenset({0}), tokenize_word=tokenize_word))
    weights = np.float32([2.0, 9.0, -1.5])
    by_words = parse_request({**inputs(text_input="Hi", max_tokens=8, min_p=0.1), P.EMBEDDING_BIAS_WORDS: np.array([b"ab", b"", b"c"], dtype=object),
                              P.EMBEDDING_BIAS_WEIGHTS: weights}, offer)
    assert by_words.params.logit_bias == ((97, 2.0), (98, 2.0), (99, -1.5)) and by_words.params.bias_words == ()
    assert abs(by_words.params.min_p - 0.1) < 1e-7
    by_ids = parse_request({**inputs(text_input="Hi", max_tokens=8), P.EMBEDDING_BIAS_TOKEN_IDS: np.int32([7, 8, 9]),
                            P.EMBEDDING_BIAS_WEIGHTS: weights}, offer)
    assert by_ids.params.logit_bias == ((7, 2.0), (8, 9.0), (9, -1.5))
    assert decode_generation(encode_generation(by_ids.params)) == by_ids.params  # the loop -> verifier wire
    with pytest.raises(InvalidRequestError) as err:
        parse_request({**inputs(text_input="Hi", max_tokens=8), P.EMBEDDING_BIAS_TOKEN_IDS: np.int32([300]),
                       P.EMBEDDING_BIAS_WEIGHTS: np.float32([1.0])}, offer)
    assert err.value.field == P.EMBEDDING_BIAS_TOKEN_IDS


def test_the_seed_arrives_under_either_tensorrt_llm_name():
    for names in (dict(seed=7), dict(random_seed=7), dict(seed=7, random_seed=7)):
        assert parse_request(inputs(text_input="Hi", max_tokens=8, **names), OFFER).params.seed == 7
    assert parse_request(inputs(text_input="Hi", max_tokens=8), OFFER).params.seed is None


def test_a_fixed_offer_refuses_other_methods_and_budgets():
    fixed = ServedOffer({"eagle3": 3}, "eagle3", 3, 512, fixed=True)
    assert resolve_method(None, None, fixed) == ("eagle3", 3)
    for method, k, field in (("none", None, P.SPECULATIVE_METHOD), ("eagle3", 0, P.NUM_DRAFT_TOKENS), ("eagle3", 5, P.NUM_DRAFT_TOKENS)):
        with pytest.raises(InvalidRequestError) as err:
            resolve_method(method, k, fixed)
        assert err.value.field == field


def test_budget_cut_and_prompt_checks():
    assert draft_budget(5, max_tokens=10, max_seq_len=100, prompt_len=10, generated=7) == 2  # 3 left: 2 drafts + bonus
    assert draft_budget(5, max_tokens=100, max_seq_len=20, prompt_len=10, generated=8) == 1  # the context binds
    assert draft_budget(5, max_tokens=10, max_seq_len=100, prompt_len=10, generated=10) == 0
    for ids, field in (([], P.TEXT_INPUT), (list(range(20)), P.TEXT_INPUT), ([5, 99], P.INPUT_IDS)):
        with pytest.raises(InvalidRequestError) as err:
            check_prompt_ids(ids, max_seq_len=20, vocab_size=50)
        assert err.value.field == field


def test_sampling_round_trips_the_wire():
    params = SamplingParams(max_tokens=33, temperature=0.7, top_k=20, top_p=0.9, seed=2**63 + 5)
    wire = encode_sampling(params)
    back = decode_sampling(wire.get)
    assert (back.max_tokens, back.top_k, back.seed) == (33, 20, 2**63 + 5)
    assert back.temperature == pytest.approx(0.7) and back.top_p == pytest.approx(0.9)
    assert decode_sampling(encode_sampling(SamplingParams(max_tokens=4)).get).seed is None


def test_logits_rules_travel_to_the_verifier_only():
    params = SamplingParams(max_tokens=9, min_length=4, end_ids=(2, 7), bad_word_ids=((5,), (8, 9, 10)),
                            repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=0.75, return_log_probs=True)
    assert set(encode_sampling(params)) == {P.MAX_TOKENS, P.TEMPERATURE, P.TOP_K, P.TOP_P}  # the drafter's
    assert decode_generation(encode_generation(params)) == params  # the verifier's: the whole record
    with pytest.raises(InvalidRequestError) as err:
        decode_generation(np.array([b"{not json"], dtype=np.object_))
    assert err.value.field == C.GENERATION


def test_token_rules_resolve_end_ids_and_bad_words():
    tokenize = {"bad": [11, 12], " bad": [13]}.get
    params = resolve_token_rules(SamplingParams(bad_words=("bad", " bad")), TokenRules(50, frozenset({2, 3}), tokenize))
    assert params.end_ids == (2, 3) and params.bad_word_ids == ((11, 12), (13,))
    params = resolve_token_rules(SamplingParams(end_id=9, pad_id=0), TokenRules(50, frozenset({2}), tokenize))
    assert params.end_ids == (9,)
    for bad, field in ((SamplingParams(end_id=50), P.END_ID), (SamplingParams(pad_id=-1), P.PAD_ID),
                       (SamplingParams(bad_words=("x",)), P.BAD_WORDS)):
        with pytest.raises(InvalidRequestError) as err:
            resolve_token_rules(bad, TokenRules(50, frozenset({2}), lambda word: []))
        assert err.value.field == field
    for needs_tokenizer, field in ((SamplingParams(stop=("x",)), P.STOP_WORDS), (SamplingParams(bad_words=("x",)), P.BAD_WORDS)):
        with pytest.raises(InvalidRequestError) as err:
            resolve_token_rules(needs_tokenizer, TokenRules(50, frozenset({2}), None))
        assert err.value.field == field


def test_the_in_process_cli_reads_requests_through_the_same_parser():
    from specdec.cli import build_parser, request_inputs
    from specdec.config import ServingConfig
    from specdec.serving.request import served_offer
    from specdec.config import SERVED_SETTINGS

    offer = served_offer(ServingConfig.from_file(SERVED_SETTINGS))
    args = build_parser().parse_args(["generate", "--prompt", "Hi", "--method", "ngram", "--stop", "END"])
    req = parse_request(request_inputs(args), offer)
    assert (req.prompt, req.method, req.num_draft_tokens, req.params.stop) == ("Hi", "ngram", offer.methods["ngram"], ("END",))
    args = build_parser().parse_args(["generate", "--prompt", "Hi", "--method", "eagle3", "--num-draft-tokens", "0"])
    assert parse_request(request_inputs(args), offer).method == METHOD_NONE
    args = build_parser().parse_args(["generate", "--prompt", "Hi", "--temperature", "1", "--top-p", "0"])
    with pytest.raises(InvalidRequestError) as err:
        parse_request(request_inputs(args), offer)
    assert err.value.field == P.TOP_P


def test_openai_bodies_are_validated_naming_the_parameter():
    """specdec openai's request parsing (no server needed): OpenAI's parameter names in every
    refusal, model ids per method, and Triton's field names mapped back to them."""
    from specdec_openai.frontend import OpenAIError, Served, parse_job, triton_error

    class Tokenizer:  # the chat template and token counts are the target's; a stand-in here
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

        def __call__(self, text, add_special_tokens):
            return type("Encoding", (), {"input_ids": text.split()})()

    served = Served("m", {"m": "", "m:none": "none", "m:ngram": "ngram"})
    chat = dict(model="m", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    job = parse_job({**chat, "max_completion_tokens": 7, "max_tokens": 99, "stop": "\n", "seed": 3}, served, Tokenizer(), chat=True)
    assert (job.prompt, job.max_tokens, job.stop, job.seed, job.temperature, job.method) == (
        "<system>Be brief.<user>Hi<assistant>", 7, ("\n",), 3, 1.0, None)
    assert parse_job({**chat, "model": "m:none"}, served, Tokenizer(), chat=True).num_draft_tokens == 0
    assert parse_job({**chat, "ignore_eos": True}, served, Tokenizer(), chat=True).ignore_eos  # benchmark tools send it
    assert parse_job({**chat, "model": "m:ngram"}, served, Tokenizer(), chat=True).method == "ngram"
    penalized = parse_job({**chat, "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "min_tokens": 4},
                          served, Tokenizer(), chat=True)
    assert (penalized.presence_penalty, penalized.frequency_penalty, penalized.repetition_penalty, penalized.min_tokens) == (
        0.5, 0.25, 1.1, 4)
    assert parse_job(dict(model="m", prompt=["raw text"]), served, Tokenizer(), chat=False).prompt == "raw text"
    biased = parse_job({**chat, "logit_bias": {"5": 2.5, "17": -100}, "min_p": 0.05}, served, Tokenizer(), chat=True)
    assert (biased.logit_bias, biased.min_p) == (((5, 2.5), (17, -100.0)), 0.05)
    counted = parse_job({**chat, "logprobs": True, "top_logprobs": 3, "n": 3, "seed": 9}, served, Tokenizer(), chat=True)
    assert (counted.logprobs, counted.top_logprobs, counted.n) == (True, 3, 3)
    from specdec_openai.frontend import choice_jobs
    assert [(j.seed, j.n) for j in choice_jobs(counted)] == [(9, 1), (10, 1), (11, 1)]
    assert parse_job(dict(model="m", prompt="raw", logprobs=0), served, Tokenizer(), chat=False).logprobs  # the token's own alone
    for body, status, param in [
        ({**chat, "model": "other"}, 404, "model"),
        ({**chat, "n": 17}, 400, "n"),
        ({**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        (dict(model="m", prompt="raw", logprobs=21), 400, "logprobs"),
        ({**chat, "presence_penalty": "high"}, 400, "presence_penalty"),
        ({**chat, "logprobs": "yes"}, 400, "logprobs"),
        ({**chat, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({**chat, "logit_bias": {"5": "up"}}, 400, "logit_bias"),
        ({**chat, "logit_bias": [5, 1]}, 400, "logit_bias"),
        ({**chat, "min_p": "low"}, 400, "min_p"),
        ({**chat, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({**chat, "max_tokens": 1.5}, 400, "max_tokens"),
        ({**chat, "max_completion_tokens": 5, "max_tokens": [8]}, 400, "max_tokens"),  # not dropped for the other (make fuzz)
        ({**chat, "max_completion_tokens": 5, "max_tokens": 0}, 400, "max_tokens"),
        ({**chat, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ({**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, 400, "tool_choice"),
        (dict(model="m", prompt="raw", tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
        ({**chat, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]}, 400,
         "messages[0].tool_calls"),
        (dict(model="m", prompt=["a", "b"]), 400, "prompt"),
    ]:
        with pytest.raises(OpenAIError) as err:
            parse_job(body, served, Tokenizer(), chat="messages" in body)
        assert (err.value.status, err.value.param) == (status, param), body
    assert triton_error("in speculative_loop: random_seed: must be in [0, 2**64)").param == "seed"
    assert triton_error("speculative_method: unknown method 'x'; known: none, max_tokens: ...").param == "speculative_method"
    assert triton_error("server busy: every sequence slot is taken").status == 503
    assert triton_error("in speculative_loop: embedding_bias_token_ids: token ids must be in [0, 49152)").param == "logit_bias"


def test_round_stats_travel_as_one_row_in_field_order():
    from specdec.triton_models.contract import STEP_STATS_FIELDS, RoundStats

    stats = RoundStats(verified=True, accepted=3, draft_depth=4, draft_tokens=6, verify_seconds=0.25, draft_seconds=0.125,
                       num_draft_tokens=5, batch_sequences=2, forced_accepted=1, cached_tokens=7)
    row = np.float32(stats.to_row())  # as the wire carries it
    assert row.shape == (len(STEP_STATS_FIELDS),) and row[STEP_STATS_FIELDS.index("cached_tokens")] == 7
    back = RoundStats.from_row(row.tolist())
    assert back == stats and isinstance(back.accepted, int) and back.verified is True


def test_tools_are_validated_rendered_forced_and_parsed():
    """specdec_openai.tool_calls without a server: tools / tool_choice refused naming the field, the
    documented template's layout, the forced call's grammar (a valid call accepted, a call
    outside the schema refused), and the Hermes parser (content around the blocks kept)."""
    import xgrammar as xgr

    from specdec_openai.tool_calls import ToolError, call_grammar, held_back, parse_tool_calls, tool_plan, with_tools

    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time"}}]
    for body, param in [({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": tools, "tool_choice": "always"}, "tool_choice"),
                        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                        ({"tools": tools + tools[:1]}, "tools")]:
        with pytest.raises(ToolError) as err:
            tool_plan(body)
        assert err.value.param == param, body
    plan = tool_plan({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert plan.forced and plan.named == "get_weather" and tool_plan({"tools": tools}).choice == "auto"
    turns = with_tools([{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                        {"role": "tool", "content": "4C"}, {"role": "tool", "content": "rain"}], plan)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert '"name": "get_time"' in turns[0]["content"] and "<tools>" in turns[0]["content"]
    assert turns[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert turns[3]["content"] == "<tool_response>\n4C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    assert with_tools([{"role": "user", "content": "Hi"}], tool_plan({"tools": tools, "tool_choice": "none"})) == [{"role": "user", "content": "Hi"}]

    grammar = xgr.Grammar.from_ebnf(call_grammar(plan))
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])).compile_grammar(grammar)

    def accepts(text: str) -> bool:  # the whole call, then the end
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(len(vocab) - 1) and matcher.is_terminated()

    assert accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')  # named: the other tool refused
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>')  # city is required
    weather_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert not accepts(weather_call + "\n" + weather_call)  # a named function: once
    for parallel, two_calls in ((True, True), (False, False)):  # required: one call or more (parallel_tool_calls)
        required = tool_plan({"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel})
        compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])).compile_grammar(
            xgr.Grammar.from_ebnf(call_grammar(required)))
        assert accepts(time_call) and accepts(weather_call + "\n" + time_call) == two_calls and not accepts("")
    with pytest.raises(ToolError) as err:
        tool_plan({"tools": tools, "parallel_tool_calls": "yes"})
    assert err.value.param == "parallel_tool_calls"

    content, calls = parse_tool_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert content == "Let me check." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])
    assert (held_back("Sure <tool"), held_back("Sure <tool_call>\n{"), held_back("Sure")) == (5, 13, 0)
