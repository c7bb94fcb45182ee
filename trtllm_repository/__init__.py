"""The TensorRT-LLM LLM-API variant of the model repository (deploy/trtllm): the config generator (`specdec trtllm-config`, generator.py), the request path its Triton model uses (requests.py) and the LLM API's names both share (llm_api.py).
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine, specdec.serving."""
from .generator import BASELINE, DEFAULT_CONFIG_FILE, TrtllmDeployment, default_variants, main
from .requests import ServedVariant, TrtllmRequest, parse_request, perf_counts, served_variant

__all__ = [
    "BASELINE", "DEFAULT_CONFIG_FILE", "ServedVariant", "TrtllmDeployment", "TrtllmRequest", "default_variants", "main",
    "parse_request", "perf_counts", "served_variant",
]
