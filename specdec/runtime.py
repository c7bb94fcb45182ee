"""Assemble an engine from a model directory and a config: the one place that wires
target, tokenizer and drafters together (used by the CLI, the benchmarks and Triton)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch

from .config import METHOD_NGRAM, EngineConfig, SpeculativeConfig
from .drafters.base import Drafter
from .drafters.ngram import NgramDrafter
from .engine import SpecEngine
from .errors import ConfigError
from .models.llama import Transformer
from .models.loading import default_model_dir, load_transformer, read_model_config

log = logging.getLogger(__name__)

DEFAULT_SPECULATIVE = {METHOD_NGRAM: SpeculativeConfig(method=METHOD_NGRAM, max_draft_len=4)}


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def build_drafters(target: Transformer, speculative: Mapping[str, SpeculativeConfig]) -> dict[str, Drafter]:
    drafters: dict[str, Drafter] = {}
    for name, spec in speculative.items():
        spec.check_target(target.cfg)
        if spec.method == METHOD_NGRAM:
            drafters[name] = NgramDrafter(spec)
        else:
            raise ConfigError("method", f"method {spec.method!r} is not available in this build")
    return drafters


def build_engine(
    model_dir: Path | None = None,
    config: EngineConfig | None = None,
    speculative: Mapping[str, SpeculativeConfig] | None = None,
) -> SpecEngine:
    config = config or EngineConfig()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = Path(model_dir or default_model_dir())
    target = load_transformer(model_dir, dtype=config.dtype, device=config.device)
    if config.compile:
        from .models.compile import compile_transformer

        compile_transformer(target)
    tokenizer = load_tokenizer(model_dir)
    drafters = build_drafters(target, DEFAULT_SPECULATIVE if speculative is None else speculative)
    return SpecEngine(target, config, tokenizer=tokenizer, drafters=drafters)


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Chat prompts go through the model's chat template (as a served instruct model would)."""
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True))
    return list(tokenizer(prompt).input_ids)


def describe(model_dir: Path | None = None) -> dict:
    cfg = read_model_config(Path(model_dir or default_model_dir()))
    return {"model_type": cfg.model_type, "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size}
