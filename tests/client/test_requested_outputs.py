"""The client names the outputs it reads (issue 74): the server builds and sends only those."""
from __future__ import annotations

import specdec_wire as P
from specdec_client import GenerateRequest, SpecDecClient
from specdec_client.client import PERF_FIELDS, requested_outputs


def test_the_ensemble_is_asked_for_its_text_finish_and_perf_only():
    names = requested_outputs("ensemble", GenerateRequest("Hi"))
    assert names == [P.TEXT_OUTPUT, P.FINISH_REASON, *PERF_FIELDS]
    assert set(names) <= set(P.MODELS["ensemble"][1])  # naming an output a model lacks is an error


def test_ids_log_probs_and_chosen_perf_where_the_model_has_them():
    request = GenerateRequest("Hi", return_log_probs=True, perf_outputs=(P.OUTPUT_TOKENS,))
    assert requested_outputs("speculative_loop", request) == [P.TEXT_OUTPUT, P.FINISH_REASON, P.OUTPUT_IDS, P.OUTPUT_TOKENS,
                                                               P.OUTPUT_LOG_PROBS, P.TOP_LOG_PROB_IDS, P.TOP_LOG_PROBS]
    assert requested_outputs("ensemble", GenerateRequest("Hi", return_perf_metrics=False)) == [P.TEXT_OUTPUT, P.FINISH_REASON]


def test_a_model_of_another_contract_gets_every_output():
    assert requested_outputs("tensorrt_llm_bls", GenerateRequest("Hi")) is None


def test_a_served_stream_carries_only_what_was_named(triton_server):
    """Through the real server: the perf outputs named arrive (on the final response too), the
    rest do not, and the text is whole."""
    named = GenerateRequest("Count to three.", max_tokens=8, temperature=0.0, ignore_eos=True, perf_outputs=(P.OUTPUT_TOKENS,))
    with SpecDecClient(triton_server.endpoints.grpc) as client:
        gen = client.generate(named)
        every = client.generate(GenerateRequest("Count to three.", max_tokens=8, temperature=0.0, ignore_eos=True))
    assert set(gen.perf) == {P.OUTPUT_TOKENS} and gen.perf[P.OUTPUT_TOKENS] == every.perf[P.OUTPUT_TOKENS] == 8
    assert set(every.perf) == set(PERF_FIELDS)
    assert gen.text == every.text and gen.text
