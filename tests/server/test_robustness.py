"""Every request is answered, and one bad request never touches another's state: malformed
strings, bad fields refused by the loop, malformed generations sent straight to the verifier
(the real Triton server)."""
from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import specdec_wire as P
from specdec.triton_models import contract as C
from specdec.config import SamplingParams
from specdec.errors import InvalidRequestError
from specdec.serving.request import ServedOffer, parse_request

from conftest import TEST_INTERNAL_KEY, read_pbtxt, write_pbtxt

pytestmark = pytest.mark.server

BAD_UTF8 = b"\xff\xfe not utf-8"
OFFER = ServedOffer({"ngram": 4}, "ngram", 16, 64)


@pytest.mark.parametrize("name", [P.TEXT_INPUT, P.STOP_WORDS, P.SPECULATIVE_METHOD])
def test_non_utf8_strings_are_refused_naming_the_field(name):
    inputs = {P.TEXT_INPUT: np.array([b"hi"], dtype=object), P.MAX_TOKENS: np.int32([4])}
    inputs[name] = np.array([BAD_UTF8], dtype=object)
    with pytest.raises(InvalidRequestError) as err:
        parse_request(inputs, OFFER)
    assert err.value.field == name


def _stream_error(server, model: str, inputs: dict) -> str | None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.endpoints.grpc)
    tensors = []
    for name, value in inputs.items():
        dtype = "BYTES" if value.dtype == object else {np.int32: "INT32"}[value.dtype.type]
        tensor = grpcclient.InferInput(name, [1, *value.shape], dtype)
        tensor.set_data_from_numpy(value[None])
        tensors.append(tensor)
    replies: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error))
    client.async_stream_infer(model, tensors, enable_empty_final_response=True)
    error = replies.get(timeout=60)
    client.stop_stream()
    client.close()
    return None if error is None else str(error)


@pytest.mark.parametrize("model, name", [("ensemble", P.STOP_WORDS), ("ensemble", P.SPECULATIVE_METHOD),
                                         ("ensemble", P.TEXT_INPUT), ("speculative_loop", P.TEXT_INPUT)])
def test_malformed_strings_get_an_answer_naming_the_field(triton_server, model, name):
    inputs = {P.TEXT_INPUT: np.array([b"Say hi."], dtype=object), P.MAX_TOKENS: np.int32([4])}
    inputs[name] = np.array([BAD_UTF8], dtype=object)
    error = _stream_error(triton_server, model, inputs)
    assert error is not None and name in error and "Traceback" not in error
    assert urllib.request.urlopen(triton_server.endpoints.http_url + "/v2/health/ready").status == 200


def test_a_bad_field_is_refused_by_the_loop_and_never_reaches_the_verifier(triton_server, grpc_client):
    """The loop validates every request, once (validate_request): a drafting budget out of
    range, an unknown method, an out-of-vocabulary prompt or one longer than the context is
    answered with an error naming the field, takes no verifier sequence, and ordinary
    requests are served."""
    active = _active_verifier_sequences(triton_server)
    ids = lambda *tokens: np.int32(list(tokens))  # noqa: E731
    for inputs, field in (({P.NUM_DRAFT_TOKENS: np.int32([10**6]), P.SPECULATIVE_METHOD: np.array([b"ngram"], dtype=object)},
                           P.NUM_DRAFT_TOKENS),
                          ({P.SPECULATIVE_METHOD: np.array([b"lookahead"], dtype=object)}, P.SPECULATIVE_METHOD),
                          ({P.INPUT_IDS: ids(10**8)}, P.INPUT_IDS),
                          ({P.INPUT_IDS: ids(*[1] * 10**5)}, P.INPUT_IDS)):
        error = _stream_error(triton_server, "speculative_loop", {P.INPUT_IDS: ids(1, 2, 3, 4), P.MAX_TOKENS: np.int32([2]), **inputs})
        assert error is not None and field in error and "Traceback" not in error, (field, error)
    assert _active_verifier_sequences(triton_server) == active
    assert grpc_client.generate(_request()).text


def test_a_malformed_generation_is_refused_by_the_verifier_alone_and_changes_nothing(triton_server, grpc_client):
    """Straight to the verifier, with the server's key (what only the loop holds): the
    verifier trusts the loop's validated fields but not the wire's form. An unreadable
    generation or one without its prompt is refused naming the field, takes no slot, and
    ordinary requests are served."""
    verifier = _VerifierCaller(triton_server, key=TEST_INTERNAL_KEY)
    active = _active_verifier_sequences(triton_server)
    good = C.encode_generation(SamplingParams(max_tokens=2, end_ids=(2,))).tolist()
    for inputs, field in (({C.GENERATION: [b"{not json"]}, C.GENERATION),
                          ({C.GENERATION: [json.dumps({"max_tokens": 2, "no_such_field": 1}).encode()]}, C.GENERATION)):
        answers = verifier.generate(4242, {P.INPUT_IDS: [1, 2, 3, 4], C.GENERATION: good, **inputs})
        assert len(answers) == 1 and isinstance(answers[0], Exception) and field in str(answers[0]), (field, answers)
    answers = verifier.generate(4244, {C.GENERATION: good})
    assert len(answers) == 1 and isinstance(answers[0], Exception) and P.INPUT_IDS in str(answers[0]), answers
    assert _active_verifier_sequences(triton_server) == active
    tokens = verifier.generate(4243, {P.INPUT_IDS: [1, 2, 3, 4], C.GENERATION: good})
    assert sum(len(r.as_numpy(P.OUTPUT_IDS).reshape(-1)) for r in tokens) == 2  # the round stream: 2 tokens in all
    verifier.close()
    assert grpc_client.generate(_request()).text


class _VerifierCaller:
    """Talks to the decoupled verifier (in its host, C.ENGINE_HOST) as a relay does (one stream per sequence; STOP by
    correlation id), with `key` or without."""

    def __init__(self, triton_server, key: str | None):
        import tritonclient.grpc as grpcclient

        self.grpcclient, self.key = grpcclient, key
        self.client = grpcclient.InferenceServerClient(triton_server.endpoints.grpc)
        self.answers: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put(error if error is not None else result))

    def _inputs(self, arrays):
        tensors = []
        for name, values in arrays.items():
            if isinstance(values[0], (str, bytes)):
                value, kind = np.array([[v.encode() if isinstance(v, str) else v for v in values]], dtype=object), "BYTES"
            elif isinstance(values[0], bool):
                value, kind = np.array([values], dtype=np.bool_), "BOOL"
            else:
                value, kind = np.array([values], dtype=np.int32), "INT32"
            tensor = self.grpcclient.InferInput(name, list(value.shape), kind)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        if self.key is not None:
            tensor = self.grpcclient.InferInput(C.INTERNAL_KEY, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[self.key.encode()]], dtype=object))
            tensors.append(tensor)
        return tensors

    def send(self, seq_id, arrays, outputs=(P.OUTPUT_IDS,)):
        self.client.async_stream_infer(C.ENGINE_HOST, self._inputs(arrays), sequence_id=seq_id, enable_empty_final_response=True,
                                       outputs=[self.grpcclient.InferRequestedOutput(n) for n in outputs])

    def collect(self, timeout_s: float = 120.0) -> list:
        """Answers until one stream's end (an error, or the final flag)."""
        out = []
        while True:
            answer = self.answers.get(timeout=timeout_s)
            out.append(answer)
            if isinstance(answer, Exception) or answer.get_response().parameters["triton_final_response"].bool_param:
                return [a for a in out if isinstance(a, Exception) or a.get_response().outputs]

    def generate(self, seq_id, arrays):
        self.send(seq_id, arrays)
        return self.collect()

    def close(self):
        self.client.stop_stream()
        self.client.close()


def test_the_internal_models_refuse_callers_without_the_servers_key(triton_server):
    """Without the per-server secret a generation takes no slot and a STOP stops nothing,
    even with a live sequence's id; with it, the STOP ends that sequence (`cancelled`). The
    loop's correlation ids are random 63-bit numbers: nobody can aim at a live one."""
    loop, stranger, guesser = (_VerifierCaller(triton_server, key) for key in (TEST_INTERNAL_KEY, None, "guess"))
    long = C.encode_generation(SamplingParams(max_tokens=400, ignore_eos=True)).tolist()
    loop.send(777, {P.INPUT_IDS: [1, 2, 3], C.GENERATION: long}, outputs=(P.OUTPUT_IDS, P.FINISH_REASON))
    first = loop.answers.get(timeout=120)
    assert not isinstance(first, Exception) and first.as_numpy(P.OUTPUT_IDS).size >= 1
    for caller in (stranger, guesser):
        refusal = caller.generate(778, {P.INPUT_IDS: [1, 2, 3], C.GENERATION: long})
        assert "speculative loop only" in str(refusal[0])
        # At someone else's sequence: refused by us, or, with no key at all (`stop` its only input),
        # already by Triton, which counts a request's inputs against the host's required ones.
        refusal = str(caller.generate(777, {C.STOP: [True]})[0])
        assert "speculative loop only" in refusal or "missing required input" in refusal, refusal
    assert _active_verifier_sequences(triton_server) == 1  # only the loop's own, still generating
    stopper = _VerifierCaller(triton_server, TEST_INTERNAL_KEY)
    assert stopper.generate(777, {C.STOP: [True]}) == []  # answered at once, empty
    rest = loop.collect()
    reasons = [bytes(r.as_numpy(P.FINISH_REASON).reshape(-1)[0]).decode() for r in rest]
    assert reasons[-1] == "cancelled" and len(rest) < 399
    deadline = time.time() + 10  # the gauge follows the cancel within a round
    while time.time() < deadline and _active_verifier_sequences(triton_server) > 0:
        time.sleep(0.1)
    assert _active_verifier_sequences(triton_server) == 0
    for caller in (loop, stranger, guesser, stopper):
        caller.close()


def _drafter_caller(client, key: str | None):
    """Calls the `drafter` model as the loop does (START: the prompt then the first token,
    and the method; later calls: what the verifier emitted), with `key` or without."""
    import tritonclient.grpc as grpcclient

    def call(seq_id, start=False, end=False, method=None, **arrays):
        tensors = []
        for name, value in arrays.items():
            tensor = grpcclient.InferInput(name, [1, len(value)], "INT32")
            tensor.set_data_from_numpy(np.int32(value)[None])
            tensors.append(tensor)
        for name, value in ((P.SPECULATIVE_METHOD, method), (C.INTERNAL_KEY, key)):
            if value is not None:
                tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
                tensor.set_data_from_numpy(np.array([[value.encode()]], dtype=object))
                tensors.append(tensor)
        return client.infer("drafter", tensors, sequence_id=seq_id, sequence_start=start, sequence_end=end,
                            outputs=[grpcclient.InferRequestedOutput(C.DRAFT_TOKENS)])

    return call


def test_the_drafter_refuses_callers_without_the_servers_key(triton_server):
    """The `drafter` model (methods served apart; conftest's draft-tiny) as the verifier
    above: without the secret a START holds no drafter state, a step on a live sequence
    drafts nothing for the caller, and an END frees nothing; the loop's own sequence carries on."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton_server.endpoints.grpc)
    loop, stranger, guesser = (_drafter_caller(client, key) for key in (TEST_INTERNAL_KEY, None, "guess"))
    start = {P.INPUT_IDS: [1, 2, 3, 4], C.NUM_DRAFT_TOKENS: [3]}  # prompt 1 2 3, first token 4
    assert loop(881, start=True, method="draft-tiny", **start).as_numpy(C.DRAFT_TOKENS).size >= 1
    assert _active_sequences(triton_server, "drafter") == 1
    for caller in (stranger, guesser):
        with pytest.raises(Exception, match="speculative loop only"):
            caller(882, start=True, method="draft-tiny", **start)
        with pytest.raises(Exception, match="speculative loop only"):
            caller(881, **{P.INPUT_IDS: [5, 6], C.NUM_ACCEPTED: [1], C.NUM_DRAFT_TOKENS: [3]})
    assert _active_sequences(triton_server, "drafter") == 1  # only the loop's own
    # Its state did not move either: its next draft is a twin sequence's that no stranger touched.
    step = {P.INPUT_IDS: [5], C.NUM_ACCEPTED: [0], C.NUM_DRAFT_TOKENS: [3]}
    drafted = loop(881, **step).as_numpy(C.DRAFT_TOKENS)
    loop(883, start=True, method="draft-tiny", **start)
    assert drafted.size >= 1 and drafted.tolist() == loop(883, **step).as_numpy(C.DRAFT_TOKENS).tolist()
    loop(883, end=True)
    with pytest.raises(Exception, match="speculative loop only"):
        stranger(881, end=True)
    assert _active_sequences(triton_server, "drafter") == 1  # our state untouched
    # Triton forgot 881 on that END: the loop frees its state with a START + END.
    try:
        loop(881, start=True, end=True, method="draft-tiny", **start)
    except Exception as exc:  # noqa: BLE001 - a drafter that refuses a second START still ends it
        assert "already running" in str(exc)
    assert _active_sequences(triton_server, "drafter") == 0
    client.close()


def _http_status(url: str, body: bytes | None = None, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers or {}), timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_admin_apis_need_the_servers_admin_key(triton_server):
    """Logging, repository control, trace, shared memory and statistics are behind the
    admin key (Triton's restricted-API feature), over HTTP and gRPC; health, metadata and
    inference stay open."""
    import tritonclient.grpc as grpcclient

    base = triton_server.endpoints.http_url
    key = {P.ADMIN_KEY_HEADER: triton_server.admin_key}
    verbose = json.dumps({"log_verbose_level": 1}).encode()
    assert _http_status(f"{base}/v2/logging", verbose) >= 400  # nobody switches on verbose logging
    assert _http_status(f"{base}/v2/repository/index", b"{}") >= 400
    assert _http_status(f"{base}/v2/models/stats") >= 400
    assert _http_status(f"{base}/v2/logging") >= 400
    assert _http_status(f"{base}/v2/logging", headers={P.ADMIN_KEY_HEADER: "guess"}) >= 400
    assert _http_status(f"{base}/v2/logging", headers=key) == 200
    assert _http_status(f"{base}/v2/repository/index", b"{}", key) == 200
    assert _http_status(f"{base}/v2/health/ready") == 200 and _http_status(f"{base}/v2/models/ensemble") == 200
    client = grpcclient.InferenceServerClient(triton_server.endpoints.grpc)
    with pytest.raises(Exception):
        client.get_model_repository_index()
    with pytest.raises(Exception):
        client.update_log_settings({"log_verbose_level": 1})
    assert client.get_model_repository_index(headers={P.ADMIN_KEY_GRPC_HEADER: triton_server.admin_key}).models
    assert client.is_server_ready()
    client.close()
    log = triton_server.log_path.read_text(errors="replace")
    assert "<admin key>" in log and triton_server.admin_key not in log  # never logged


def _active_verifier_sequences(server) -> float:
    return _active_sequences(server, "verifier")


def _active_sequences(server, model: str) -> float:
    text = urllib.request.urlopen(server.endpoints.metrics_url).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(P.ACTIVE_SEQUENCES + "{") and f'model="{model}"' in line)


def _request():
    from specdec_client import GenerateRequest

    return GenerateRequest("Name a colour.", max_tokens=4)


@pytest.fixture(scope="module")
def two_slot_server(tmp_path_factory, smol_dir):
    """The model repository with two sequence slots and a 1 s admission timeout."""
    import json
    import shutil

    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

    root = tmp_path_factory.mktemp("two_slots")
    repo = root / "model_repository"
    shutil.copytree(DEFAULT_MODEL_REPOSITORY, repo, ignore=shutil.ignore_patterns("__pycache__"))
    for model in ("drafter",):
        config = read_pbtxt(repo / model / "config.pbtxt")
        config.max_batch_size = 2
        config.sequence_batching.oldest.max_candidate_sequences = 2
        write_pbtxt(repo / model / "config.pbtxt", config)
    settings = json.loads((repo / "specdec.json").read_text())
    settings["engine"].update(max_batch_size=2, max_seq_len=512, max_tokens_limit=512)
    settings["admission_timeout_s"] = 1.0
    # Slots and admission are what is tested: one method that drafts in the verifier (no heads,
    # no planner calibration) keeps the server's start short.
    settings["methods"] = {"ngram": settings["methods"]["ngram"]}
    settings["default_method"] = "ngram"
    (repo / "specdec.json").write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=root / "triton.log")
    server.start(repo, http_port=http, grpc_port=grpc, metrics_port=metrics)
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


def test_a_full_server_refuses_new_requests_as_busy_after_the_admission_timeout(two_slot_server):
    from specdec_client import GenerateRequest, ServerError, SpecDecClient

    grpc = two_slot_server.endpoints.grpc
    long = GenerateRequest("Count to one thousand.", max_tokens=400, ignore_eos=True, num_draft_tokens=0)
    holders = [SpecDecClient(grpc, model="speculative_loop") for _ in range(2)]
    streams = [client.stream(long) for client in holders]
    for stream in streams:
        next(stream)  # both slots are taken
    with SpecDecClient(grpc) as client:
        with pytest.raises(ServerError, match="busy"):
            client.generate(GenerateRequest("Name a colour.", max_tokens=4))
        for stream, holder in zip(streams, holders):
            stream.close()  # cancels through speculative_loop: the slots free at once
            holder.close()
        assert client.generate(GenerateRequest("Name a colour.", max_tokens=4)).text  # admitted again


def test_a_full_server_shows_in_the_slot_metrics_within_one_scrape(two_slot_server):
    """The autoscaling signal: a request waiting for a slot waits inside the loop, where
    Triton's queue metrics never see it. Three streams on two slots: occupancy reads 1.0,
    the waiter shows while it waits, and its wait lands in the slot-wait histogram."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from specdec_client import GenerateRequest, ServerError, SpecDecClient, server_metrics as sm

    def scrape():
        return sm.scrape(two_slot_server.endpoints.metrics_url)

    def waits(samples, suffix):
        return sm.total(samples, P.SLOT_WAIT_SECONDS + suffix, model="ensemble")

    def settled(name, model, value):
        """A scrape once the gauge reads `value`: a slot is released just after the final
        response, so a client can scrape before the gauge has moved."""
        deadline = time.monotonic() + 60
        while sm.total(samples := scrape(), name, model=model) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return samples

    grpc = two_slot_server.endpoints.grpc
    idle = settled(P.SLOT_OCCUPANCY, "ensemble", 0.0)
    assert sm.total(idle, P.SLOT_OCCUPANCY, model="ensemble") == 0.0
    assert sm.total(idle, P.SLOT_WAITING, model="ensemble") == 0.0
    long = GenerateRequest("Count to one thousand.", max_tokens=400, ignore_eos=True, num_draft_tokens=0)
    holders = [SpecDecClient(grpc, model="speculative_loop") for _ in range(2)]
    streams = [client.stream(long) for client in holders]
    try:
        for stream in streams:
            next(stream)  # both slots are taken
        assert sm.total(scrape(), P.SLOT_OCCUPANCY, model="speculative_loop") == 1.0
        with SpecDecClient(grpc) as client, ThreadPoolExecutor(1) as pool:
            refused = pool.submit(client.generate, GenerateRequest("Name a colour.", max_tokens=4))
            waiting = []
            while not refused.done():  # the admission timeout is 1 s: many scrapes fall inside it
                waiting.append(sm.total(scrape(), P.SLOT_WAITING, model="ensemble"))
                time.sleep(0.02)
            with pytest.raises(ServerError, match="busy"):
                refused.result()
        assert max(waiting) == 1.0
        full = scrape()  # one scrape: still full, and the wait is counted
        assert sm.total(full, P.SLOT_OCCUPANCY, model="speculative_loop") == 1.0
        assert sm.total(full, P.SLOT_WAITING, model="ensemble") == 0.0
        assert waits(full, "_count") == waits(idle, "_count") + 1
        assert waits(full, "_sum") - waits(idle, "_sum") >= 1.0  # it waited out admission_timeout_s
        assert sm.total(full, P.SLOT_WAIT_SECONDS + "_bucket", model="ensemble", le="+Inf") == waits(full, "_count")
    finally:
        for stream, holder in zip(streams, holders):
            stream.close()  # cancels: the slots free at the loop's next step
            holder.close()
    assert sm.total(settled(P.SLOT_OCCUPANCY, "speculative_loop", 0.0), P.SLOT_OCCUPANCY, model="speculative_loop") == 0.0


def test_shared_slots_are_one_pool_across_processes_and_freed_when_a_holder_dies(tmp_path):
    """The two served names run in separate processes; their admission permits are one pool."""
    import asyncio
    import multiprocessing

    from specdec.triton_models.slots import SharedSlots

    mine = SharedSlots(2, server_id=4242)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # another process takes one slot and keeps it while alive
        held = pool.apply_async(_hold_a_slot, (4242,))
        assert held.get(timeout=60) is not None
        assert mine.try_acquire() is not None  # the other slot
        assert mine.try_acquire() is None  # the pool is empty in THIS process too
        assert asyncio.run(mine.acquire(0.05)) is None
    # The holder's process is gone: the kernel released its lock.
    assert mine.try_acquire() is not None


def test_waiters_get_freed_slots_in_arrival_order():
    """First come, first served within a process: under overload no waiter is passed over
    until its admission timeout (the c=32 benchmark on 16 slots once refused one after 60 s)."""
    import asyncio
    import os

    from specdec.triton_models.slots import SharedSlots

    slots = SharedSlots(1, server_id=os.getpid() * 7 + 1)
    order = []

    async def wait(name):
        # The oldest polls slowest: without the order, a faster later poller would win.
        slot = await slots.acquire(5.0, poll_s=0.01 if name == "a" else 0.001)
        order.append(name)
        await asyncio.sleep(0.02)  # hold it a little, then hand it on
        slots.release(slot)

    async def main():
        first = slots.try_acquire()
        assert first is not None
        tasks = [asyncio.create_task(wait(name)) for name in ("a", "b", "c")]
        await asyncio.sleep(0.05)
        assert slots.waiting == 3
        slots.release(first)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert order == ["a", "b", "c"] and slots.waiting == 0


def _hold_a_slot(server_id):
    import specdec.triton_models.slots as slots

    global _KEEP
    _KEEP = slots.SharedSlots(2, server_id=server_id)
    return _KEEP.try_acquire()
