"""The data drafters train on: ShareGPT conversations through the target's chat template
(seeded selection, the held-out part, its user openings), the self-distillation prompt
order (the benchmarks' prompts and the held-out openings left out), the target's stored
answers (`specdec distill-answers` shards of token ids), and the fp32 target that labels
them with its tokenizer. Both train-eagle3 (and the trainers that share its data) and
distill-answers read it; it imports neither.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import torch

from specdec.config import default_model_dir
from specdec.engine.models.llama import Transformer
from specdec.engine.models.loading import load_transformer
from specdec.serving.runtime import encode_prompt, load_tokenizer
from specdec.tools.sharegpt import sharegpt_conversations, sharegpt_prompts

# How a base model (no chat template) reads a conversation: its turns as paragraphs.
PLAIN_TURN_SEPARATOR = "\n\n"
ANSWERS_DIR = Path("data/answers")


def select_conversations(tokenizer, n: int, max_len: int, seed: int) -> list[list[int]]:
    convs = list(sharegpt_conversations())
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs:
        messages = [{"role": r, "content": t} for r, t in conv if r in ("user", "assistant")]
        if len(messages) < 2 or messages[0]["role"] != "user":
            continue
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
        else:  # a base model (Gemma 3 270M) reads the conversation as plain text, as it is served
            ids = tokenizer(PLAIN_TURN_SEPARATOR.join(m["content"] for m in messages)).input_ids
        if len(ids) >= 32:
            out.append(list(ids[:max_len]))
        if len(out) == n:
            break
    return out


def user_openings(seqs: list[list[int]], tokenizer) -> list[list[int]]:
    """The chat-template prefix up to the first assistant header of each held-out sequence (a
    base model's: the text up to its first turn separator)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    header = tokenizer.encode("<|im_start|>assistant\n" if chat else PLAIN_TURN_SEPARATOR, add_special_tokens=False)
    keep = len(header) if chat else 0
    out = []
    for ids in seqs:
        for i in range(len(ids) - len(header)):
            if ids[i : i + len(header)] == header:
                out.append(ids[: i + keep])
                break
    return out


def heldout_openings(tokenizer, conversations: int, max_len: int, seed: int, holdout: float = 0.05) -> set[tuple[int, ...]]:
    """The user openings of train-eagle3's held-out conversations (never trained on)."""
    seqs = select_conversations(tokenizer, conversations, max_len, seed)
    n_held = max(1, int(len(seqs) * holdout))
    return {tuple(ids) for ids in user_openings(seqs[-n_held:], tokenizer)}


def benchmark_prompt_texts(first: int = 1000) -> set[str]:
    """The prompts the benchmarks draw first (bench-engine / bench-serving order, and the
    client's `bench` / Locust order, both seed 0), never trained on so that measured
    acceptance is on unseen prompts. `first` unfiltered draws cover any filtered prefix the
    benchmarks take."""
    reserved = {t.strip() for t in sharegpt_prompts(first, seed=0, tokenizer=None, min_tokens=0, max_tokens=10**9)}
    try:
        from specdec_client.datasets import load_sharegpt, whitespace_counter
    except ImportError:  # the client package is not installed: only the engine benchmarks' order
        return reserved
    reserved |= {p.text.strip() for p in load_sharegpt(first, 0, whitespace_counter(), 0, 10**9).prompts}
    return reserved


def distill_prompts(tokenizer, n: int, seed: int, exclude: set[tuple[int, ...]], draw: int | None = None) -> list[list[int]]:
    """The first n prompts (chat-templated ids) of the self-distillation order: first-turn
    ShareGPT prompts of 4-192 tokens shuffled with seed + 1, without the benchmarks' prompts
    and the held-out conversations' openings (`exclude`). The order does not depend on n.
    `draw` caps the prompts taken before those are left out (the shipped heads'
    --self-distill N drew N + len(exclude) + 64, so N = 3200 gave 2631 prompts)."""
    reserved = benchmark_prompt_texts()
    draw = draw if draw is not None else n + len(exclude) + len(reserved) + 64
    texts = [t for t in sharegpt_prompts(draw, seed=seed + 1, tokenizer=tokenizer, min_tokens=4, max_tokens=192)
             if t.strip() not in reserved]
    return [ids for ids in (encode_prompt(tokenizer, t) for t in texts) if tuple(ids) not in exclude][:n]


def second_turn(tokenizer, conv, exclude: set[tuple[int, ...]]) -> tuple[str, list[int]] | None:
    """(turn one's text, the chat-templated ids of its first three turns up to the assistant
    header: turn one, its dataset answer, turn two) of a conversation that opens with a user
    turn and whose opening is not in `exclude`; None otherwise."""
    turns = [(r, t) for r, t in conv if r in ("user", "assistant")]
    if len(turns) < 3 or turns[0][0] != "user":
        return None
    messages = [{"role": r, "content": t} for r, t in turns[:3]]
    if tuple(tokenizer.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)) in exclude:
        return None
    return turns[0][1], list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))


def second_turn_prompts(tokenizer, n: int, seed: int, exclude: set[tuple[int, ...]]) -> list[list[int]]:
    """The first n second-turn prompts (turn one, its dataset answer, turn two, chat-templated,
    32-512 tokens) of the self-distillation order: ShareGPT conversations shuffled with seed + 2,
    without those whose first prompt the benchmarks reserve (bench-head-acceptance's multi-turn
    workload is drawn from those) or whose opening is held out (`exclude`). The first-turn
    prompts ran out at 6,624; these are the next data. The order does not depend on n."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("second-turn prompts need a chat template (a base model has no turns)")
    reserved = benchmark_prompt_texts()
    conversations = list(sharegpt_conversations())
    random.Random(seed + 2).shuffle(conversations)
    out = []
    for conv in conversations:
        found = second_turn(tokenizer, conv, exclude)
        if found is not None and found[0].strip() not in reserved and 32 <= len(found[1]) <= 512:
            out.append(found[1])
            if len(out) == n:
                break
    return out


# A first-turn prompt that asks about code: a fence, a language or a code word.
CODE_PROMPT = re.compile(r"```|\bdef |\bfunction\b|\bclass \w|#include|\bselect\b.*\bfrom\b|\bcode\b|\bpython\b|"
                         r"\bjavascript\b|\btypescript\b|\bjava\b|c\+\+|\bsql\b|\bhtml\b|\bcss\b|\breact\b|\brust\b|"
                         r"\bgolang\b|\bbash\b|\bregex\b|\bapi\b|\bscript\b", re.IGNORECASE)


def code_prompts(tokenizer, n: int, seed: int, exclude: set[tuple[int, ...]] = frozenset()) -> list[str]:
    """n first-turn ShareGPT prompts about code (CODE_PROMPT), 16-256 tokens chat-templated,
    in a seeded order, without the benchmarks' prompts and those whose templated ids are
    `exclude`d (what a head trained on): the code workload of the capture cycle, split by
    the caller."""
    reserved = benchmark_prompt_texts()
    firsts = [conv[0][1] for conv in sharegpt_conversations() if conv[0][0] == "user"]
    random.Random(seed).shuffle(firsts)
    out = []
    for text in firsts:
        if text.strip() in reserved or not CODE_PROMPT.search(text):
            continue
        ids = encode_prompt(tokenizer, text)
        if 16 <= len(ids) <= 256 and tuple(ids) not in exclude:
            out.append(text)
            if len(out) == n:
                break
    return out


# The default target's answers keep the directory name they were first stored under.
DEFAULT_ANSWERS_TARGET = "smollm2-135m"


def answers_dir(new_tokens: int, seed: int, turn: int = 1, target: str = DEFAULT_ANSWERS_TARGET) -> Path:
    """data/answers/<target>-greedy-t<new tokens>-seed<seed>[-turn2]: one directory per target,
    so another target's answers never land among the default's."""
    return ANSWERS_DIR / (f"{target}-greedy-t{new_tokens}-seed{seed}" + (f"-turn{turn}" if turn != 1 else ""))


def save_shard(path: Path, indices: list[int], prompts: list[list[int]], answers: list[list[int]], vocab_size: int | None = None) -> None:
    """vocab_size: the target's, recorded so that a shard is never read as another target's
    ids (older shards, all SmolLM2's, have none)."""
    dtype = np.uint16 if (vocab_size or 0) <= 2**16 else np.uint32  # SmolLM2's 49,152 ids fit 16 bits, Gemma 3's 262,144 do not

    def flat(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        ids = np.array([t for r in rows for t in r], dtype=np.int64)
        if ids.size and ids.max() > np.iinfo(dtype).max:
            raise ValueError(f"token id {int(ids.max())} does not fit {dtype.__name__}: pass the target's vocab_size")
        return ids.astype(dtype), offsets

    prompt_ids, prompt_offsets = flat(prompts)
    answer_ids, answer_offsets = flat(answers)
    recorded = {} if vocab_size is None else {"vocab_size": np.array(vocab_size, dtype=np.int64)}
    tmp = path.parent / f".{path.name}"  # not matched by shard_*.npz until renamed
    np.savez_compressed(tmp, index=np.array(indices, dtype=np.int64), prompt_ids=prompt_ids, prompt_offsets=prompt_offsets,
                        answer_ids=answer_ids, answer_offsets=answer_offsets, **recorded)
    tmp.rename(path)  # a shard is there whole or not at all


def load_shard(path: Path, vocab_size: int | None = None) -> list[tuple[int, list[int], list[int]]]:
    """[(prompt index, prompt ids, answer ids)]; with vocab_size (the reading target's), a
    shard another target made is refused: its recorded vocabulary differs, or an id is past it."""
    z = np.load(path)
    if vocab_size is not None:
        recorded = int(z["vocab_size"]) if "vocab_size" in z else None
        too_big = max((int(z[k].max()) for k in ("prompt_ids", "answer_ids") if z[k].size), default=-1) >= vocab_size
        if (recorded is not None and recorded != vocab_size) or too_big:
            raise ValueError(f"{path}: answers of another target (vocabulary {recorded or 'larger'}, this target's {vocab_size}): "
                             "--answers names the reading target's own directory")
    po, ao = z["prompt_offsets"], z["answer_offsets"]
    return [(int(i), z["prompt_ids"][po[k] : po[k + 1]].astype(np.int64).tolist(), z["answer_ids"][ao[k] : ao[k + 1]].astype(np.int64).tolist())
            for k, i in enumerate(z["index"])]


def load_answers(directory: Path, limit: int | None = None) -> list[tuple[int, list[int], list[int]]]:
    """Every stored (prompt index, prompt ids, answer ids), in prompt order, up to `limit` prompts."""
    out = []
    for path in sorted(directory.glob("shard_*.npz")):
        out += load_shard(path)
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def answers_new_tokens(answers: str) -> int | None:
    """The token budget the stored answers were generated with (answers_dir names it)."""
    found = re.search(r"-t(\d+)-", Path(answers).name)
    return int(found.group(1)) if found else None


def target_and_tokenizer(args) -> tuple[Transformer, object]:
    """The fp32 target the training tools initialise drafters from (its weights; with the default
    --feature-format float32 it also labels their data), and its tokenizer (--model-dir, --threads)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or default_model_dir())
    return load_transformer(model_dir, dtype="float32"), load_tokenizer(model_dir)


# The weight formats the target can compute training features and labels in (--feature-format).
FEATURE_FORMATS = ("float32", "int8", "bfloat16")


def labelling_target(target: Transformer, args) -> Transformer:
    """The target that computes the features and labels a drafter trains on and is checked
    against, in --feature-format. float32 is the reference. int8 is the served CPU target
    itself: its argmax differs from float32's at ~3% of positions of its own text (measured on
    stored answers), so a head taught float32's labels is taught those positions wrong; its
    prefill costs what float32's does. bfloat16 computes features ~2.3x faster on CPUs with
    AMX or AVX-512 BF16, its argmax as close to int8's as float32's is."""
    if args.feature_format == "float32":
        return target
    model_dir = Path(args.model_dir or default_model_dir())
    if args.feature_format == "bfloat16":
        return load_transformer(model_dir, dtype="bfloat16")
    from specdec.engine.models.quantized import quantize

    return quantize(load_transformer(model_dir, dtype="float32"), "int8", model_dir)


def feature_cache_suffix(feature_format: str) -> str:
    """Features of two weight formats never share a cache directory."""
    return "" if feature_format == "float32" else f"-{feature_format}"
