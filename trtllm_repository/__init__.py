"""The TensorRT-LLM LLM-API variant of the model repository (deploy/trtllm): the config generator (`specdec trtllm-config`) and the request mapping its Triton model uses.
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine, specdec.serving."""
from .generator import (
    BASELINE,
    DEFAULT_CONFIG_FILE,
    LlmRequest,
    ServedVariant,
    TrtllmDeployment,
    default_variants,
    main,
    parse_request,
    perf_counts,
    served_variant,
)

__all__ = [
    "BASELINE", "DEFAULT_CONFIG_FILE", "LlmRequest", "ServedVariant", "TrtllmDeployment", "default_variants", "main",
    "parse_request", "perf_counts", "served_variant",
]
