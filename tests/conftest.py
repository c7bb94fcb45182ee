"""Shared fixtures: tiny random HF checkpoints (fast) and the prepared SmolLM2 target.

tests/ is laid out by layer: engine/ (in process, no Triton), serving/ (the engine loop, the
request parser, the drafter served apart with Triton faked), server/ (the real Triton server),
client/ (the client package, benchmarks, Locust), deploy/ (deployment files and the TensorRT-LLM
variant, offline), project/ (the repository's own rules) and support/ (helpers and fixtures, no
tests). Tests share helpers and fixtures across layers by module name, so every folder is on
sys.path (names are unique across folders)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
for folder in ("support", "engine", "serving", "server", "client", "deploy", "project"):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))

# Under pytest-xdist each worker takes its share of the cores (the mutation harness's copies set
# SPECDEC_TEST_THREADS), and so do the servers and subprocesses it starts. OpenMP teams that
# together outnumber the cores spin against each other (GNU OpenMP spins before it sleeps):
# measured in process on 2 cores, two plain-decoding runs at 2 threads each made 6 tok/s apiece
# (66 alone), at 1 thread each 42 apiece.
CORES = len(os.sched_getaffinity(0))
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = int(os.environ.get("SPECDEC_TEST_THREADS", str(max(1, CORES // WORKERS))))
torch.set_num_threads(THREADS)
if THREADS < CORES:
    os.environ.setdefault("SPECDEC_MAX_THREADS", str(THREADS))  # specdec.config.MAX_THREADS_ENV
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """With `--dist loadgroup` (make test): every test of the shared Triton server runs on one
    worker, so the server starts once per run, and every other module stays on one worker, so a
    module's fixtures (an engine, a server of its own) are built once. Without tryfirst xdist saw no
    group: each worker started its own shared server, and two workers wrote test_layering's probe
    file into one package at once."""
    for item in items:
        uses_server = "triton_server" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group("triton_server" if uses_server else item.nodeid.split("::")[0]))


@pytest.fixture(scope="module", autouse=True)
def give_back_freed_memory():
    """After each module: collect its engines and servers' clients and hand the freed heap back
    to the OS. A worker's resident memory otherwise only grows (glibc keeps freed arenas): the
    two-worker suite peaked at 22.7 of 24 GiB near its end, 6 GiB in one worker; trimmed after
    each module, six engine modules in one process ended at 2.4 GiB instead of 3.5."""
    yield
    import gc

    from specdec.serving.heap import HeapTrimmer

    gc.collect()
    HeapTrimmer(every_s=0.0).maybe_trim()


def read_pbtxt(path: Path):
    """A config.pbtxt parsed against Triton's own schema (ModelConfig, as shipped by
    tritonclient): an unknown field or a bad value fails here as it would in tritonserver."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def write_pbtxt(path: Path, config) -> None:
    from google.protobuf import text_format

    Path(path).write_text(text_format.MessageToString(config))


def pbtxt_tensors(config, section: str) -> dict[str, tuple]:
    """name -> (data type, dims, optional) of a ModelConfig's `input` or `output` tensors."""
    from tritonclient.grpc import model_config_pb2

    def optional(t) -> bool:  # ModelOutput has no such field: outputs are never optional
        return "optional" in t.DESCRIPTOR.fields_by_name and t.optional

    return {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims), optional(t)) for t in getattr(config, section)}


def ancestor_mask(parents: list[int]):
    """A draft tree's [n, n] ancestor-or-self mask from each node's parent (-1: the root's child)."""
    import torch

    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for j, p in enumerate(parents):
        mask[j, j] = True
        while p >= 0:
            mask[j, p] = True
            p = parents[p]
    return mask


def save_tiny_hf(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random tiny HF checkpoint (config.json + safetensors) with transformers."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    )
    common.update(overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "mistral":  # sliding-window attention: pass sliding_window
        model = MistralForCausalLM(MistralConfig(**common))
    elif arch == "gemma3":  # local sliding-window layers beside a global one, sandwich norms, GELU, scaled embeddings
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        gemma = {"head_dim": common["hidden_size"] // common["num_attention_heads"], "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"][: common["num_hidden_layers"]],
                 "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{**gemma, **common}))
        with torch.no_grad():  # Gemma's norms scale by (1 + w) and start at w = 0: make them matter
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": common["hidden_size"] // common["num_attention_heads"], **common}))
        with torch.no_grad():  # q/k norm weights start at 1: make them matter
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init has tiny logits spread; scale the head so sampling tests see real distributions.
    model.eval()
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_hf(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """The opt-in Gemma 3 270M target (make prepare-gemma); its tests are marked gemma and run
    by make test-gemma, outside make test."""
    from specdec.config import gemma_model_dir
    from specdec.engine.models.loading import cache_is_valid

    if not cache_is_valid(gemma_model_dir()):
        pytest.skip("Gemma 3 270M is not prepared (make prepare-gemma)")
    return gemma_model_dir()


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from specdec.engine.models.loading import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def smol_model(smol_dir):
    from specdec.engine.models.loading import load_transformer

    return load_transformer(smol_dir)


@pytest.fixture(scope="session")
def smol_int8_model(smol_dir):
    """The target as it ships (specdec.json's weight_format: int8, the row-invariant kernels)."""
    from specdec.config import EngineConfig
    from specdec.serving.runtime import load_target

    return load_target(smol_dir, EngineConfig(weight_format="int8"))


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from specdec.serving.runtime import load_tokenizer

    return load_tokenizer(smol_dir)


# The per-server secret of the test server: tests that call the internal models directly
# (as an attacker would, or with the key, as the loop does) need to know it.
TEST_INTERNAL_KEY = "test-internal-key"


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, smol_dir):
    """The real model repository on the real tritonserver, on free ports, with settings
    that keep the KV cache small (max_seq_len 512)."""
    import json

    from specdec.triton_models.keys import INTERNAL_KEY_ENV
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

    settings = json.loads((DEFAULT_MODEL_REPOSITORY / "specdec.json").read_text())
    settings["engine"].update(max_seq_len=512, max_tokens_limit=512)
    # Load controls through the real loop: batch <= 2 drafts 5, 3-4 drafts 1, more drafts nothing.
    settings["methods"]["eagle3-busy"] = {"method": "eagle3", "max_draft_len": 5, "draft_len_schedule": {"2": 5, "4": 1}}
    # The two-model path: the head in the `drafter` model, a draft call and a verify call per step.
    settings["methods"]["eagle3-apart"] = {"method": "eagle3", "max_draft_len": 5, "colocated": False}
    # An independent draft model from an HF checkpoint on disk: a tiny random-init Llama with
    # the target's vocabulary and special tokens, served by the `drafter` model.
    tiny_draft = save_tiny_hf(tmp_path_factory.mktemp("tiny_draft"), vocab_size=49152, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, max_position_embeddings=2048)
    settings["methods"]["draft-tiny"] = {"method": "draft_model", "speculative_model": str(tiny_draft), "max_draft_len": 3,
                                         "colocated": False}
    path = tmp_path_factory.mktemp("settings") / "specdec.json"
    path.write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=tmp_path_factory.mktemp("triton") / "triton.log")
    server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics,
                 env={"SPECDEC_SETTINGS": str(path), INTERNAL_KEY_ENV: TEST_INTERNAL_KEY})
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()
    # A clean shutdown too: every stub's metrics were left to the interpreter's exit, and each
    # verifier then segfaulted in ~MetricFamily (found in a fuzz run's log; Metrics.close).
    assert "Segfault encountered" not in server.log_path.read_text(errors="replace"), server.log_tail(60)


@pytest.fixture()
def grpc_client(triton_server):
    from specdec_client import SpecDecClient

    with SpecDecClient(triton_server.endpoints.grpc, protocol="grpc") as client:
        yield client


@pytest.fixture()
def http_client(triton_server):
    from specdec_client import SpecDecClient

    with SpecDecClient(triton_server.endpoints.http, protocol="http") as client:
        yield client
