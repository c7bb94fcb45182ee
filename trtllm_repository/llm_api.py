"""What TensorRT-LLM's LLM API calls our methods and which of its releases run what: shared by
the config generator (generator.py) and the request mapping of the served model (requests.py).
Needs neither TensorRT-LLM nor Triton."""
from __future__ import annotations

from packaging.version import InvalidVersion, Version

from specdec.config import METHOD_DRAFT_MODEL, METHOD_EAGLE3, METHOD_EAGLE3_TREE, METHOD_MEDUSA, METHOD_NGRAM
from specdec.errors import ConfigError

# TensorRT-LLM's decoding_type per method of ours.
DECODING_TYPES = {METHOD_EAGLE3: "Eagle3", METHOD_EAGLE3_TREE: "Eagle3", METHOD_DRAFT_MODEL: "Draft_Target", METHOD_NGRAM: "NGram",
                  METHOD_MEDUSA: "Medusa"}
# Drafters TensorRT-LLM runs inside the target's forward (one-model EAGLE-3). In 1.2.x they
# draft and verify greedily unless speculative_config.allow_advanced_sampling is set: a
# request with temperature > 0 would get greedy output (llm_args.DecodingBaseConfig; the
# two-model paths, Draft_Target and NGram, always sample). Later releases read sampling per
# request and keep the flag as a no-op.
ONE_MODEL_METHODS = (METHOD_EAGLE3, METHOD_EAGLE3_TREE)
# The TensorRT-LLM release the GPU image serves: NGC tritonserver 26.07-trtllm-python-py3
# ships 1.2.1 (triton-inference-server/server docs/introduction/compatibility.md);
# deploy/docker/Dockerfile.gpu asserts it at build time.
PINNED_TRTLLM = "1.2.1"
# The PyTorch backend's one-model EAGLE-3 path reads use_dynamic_tree / dynamic_tree_max_topK
# from 1.3.0rc13 on (NVIDIA/TensorRT-LLM#13081). Before it, Eagle3DecodingConfig sets
# max_total_draft_tokens = max_draft_len and drafts a chain: a tree file would claim a
# budget the server does not run.
DYNAMIC_TREE_SINCE = "1.3.0rc13"
PYTORCH_BACKEND = "pytorch"
# Medusa in 1.2.x: MedusaDecodingConfig.supports_backend(backend) is `backend not in ("pytorch",
# "_autodeploy")`, so TorchLlmArgs refuses it ("Speculation type Medusa does not support backend
# pytorch"); TrtLlmArgs.validate_speculative_config takes it (build_config.max_draft_len =
# max_draft_len, DecodingConfig(DecodingMode.Medusa(), medusa_choices)). Checked in
# NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py of the 1.2 line (DecodingBaseConfig with
# allow_advanced_sampling, Eagle3DecodingConfig refused by TrtLlmArgs, no dynamic tree before
# 1.3.0rc13) and, unchanged, in the 1.0/1.1 files; the TensorRT backend's LLM is
# tensorrt_llm._tensorrt_engine.LLM (examples/llm-api/llm_medusa_decoding.py). The medusa files
# and their matched baseline therefore say backend: tensorrt and leave out cuda_graph_config,
# a TorchLlmArgs field the TensorRT backend's LLM refuses as an invalid argument.
TENSORRT_BACKEND = "tensorrt"


def supports_dynamic_tree(trtllm_version: str) -> bool:
    try:
        return Version(trtllm_version) >= Version(DYNAMIC_TREE_SINCE)
    except InvalidVersion as exc:
        raise ConfigError("trtllm_version", f"not a version: {trtllm_version!r}") from exc
