"""Gemma 3's tokenizer rebuilt from its GGUF file.

transformers (4.57) reads a Gemma GGUF's vocabulary into a Unigram model. Gemma 3's
SentencePiece model is BPE, and the GGUF's scores are its merge ranks (-rank), so the
Unigram reading cuts words into pieces the model never saw in training ("Hello world" ->
Hello / ▁w / or / ld instead of Hello / ▁world) and the model's outputs degrade. Here the
same vocabulary becomes a byte-fallback BPE whose merges come from those ranks
(transformers' own generate_merges, as its SentencePiece converter does), with the GGUF's
control tokens as special tokens and its user-defined tokens (newline and space runs,
markup) matched whole, as SentencePiece matches them.
"""
from __future__ import annotations

from pathlib import Path

# GGUF token types (llama.cpp's llama_token_type): what each vocabulary entry is.
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4


def _field(reader, key: str) -> list:
    field = reader.fields[key]
    return [field.parts[index] for index in field.data]


def _scalar(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.parts[field.data[0]][0]


def gemma_tokenizer_from_gguf(gguf_path: Path):
    """A PreTrainedTokenizerFast equal in vocabulary and ids to the GGUF's, segmenting as
    SentencePiece-BPE does."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    reader = GGUFReader(str(gguf_path))
    tokens = [bytes(part).decode("utf-8") for part in _field(reader, "tokenizer.ggml.tokens")]
    scores = [float(part[0]) for part in _field(reader, "tokenizer.ggml.scores")]
    types = [int(part[0]) for part in _field(reader, "tokenizer.ggml.token_type")]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = generate_merges(vocab, dict(zip(tokens, scores)))

    def named(key: str) -> str:
        return tokens[int(_scalar(reader, key))]

    bos, eos, unk, pad = (named(f"tokenizer.ggml.{kind}_token_id") for kind in ("bos", "eos", "unknown", "padding"))
    backend = Tokenizer(BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")  # add_space_prefix is false for Gemma 3
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED])
    if bool(_scalar(reader, "tokenizer.ggml.add_bos_token", True)):
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad)
