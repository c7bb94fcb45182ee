"""Gemma 3's tokenizer rebuilt from a GGUF file's vocabulary: SentencePiece-BPE by the GGUF's
merge ranks, byte fallback, control tokens special, user-defined tokens whole. A tiny GGUF
written here (the real one is the opt-in Gemma download)."""
from __future__ import annotations

import pytest

from specdec.engine.models.gguf_tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED, gemma_tokenizer_from_gguf

TOKEN_NORMAL, TOKEN_BYTE = 1, 6
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
# Merge order (rank): earlier pieces merge first, as a SentencePiece-BPE model's scores say.
PIECES = ["▁w", "or", "ld", "He", "ll", "▁wor", "▁world", "Hell", "Hello", "o", "▁", "w", "r", "l", "d", "H", "e"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    tokens = SPECIALS + ["\n\n"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = ([TOKEN_CONTROL] * len(SPECIALS) + [TOKEN_USER_DEFINED] + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * len(PIECES))
    scores = [-1000.0] * (len(SPECIALS) + 1 + 256) + [-float(rank) for rank in range(len(PIECES))]
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, {t: i for i, t in enumerate(tokens)}


def test_words_merge_by_rank_as_sentencepiece_bpe(gguf_file):
    """A Unigram reading of the same scores cuts "world" into pieces; BPE by rank keeps it whole."""
    path, vocab = gguf_file
    tokenizer = gemma_tokenizer_from_gguf(path)
    ids = tokenizer("Hello world").input_ids
    assert ids == [vocab["<bos>"], vocab["Hello"], vocab["▁world"]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"


def test_bytes_fall_back_and_user_tokens_stay_whole(gguf_file):
    path, vocab = gguf_file
    tokenizer = gemma_tokenizer_from_gguf(path)
    ids = tokenizer("Hello\n\né<start_of_turn>", add_special_tokens=False).input_ids
    assert ids == [vocab["Hello"], vocab["\n\n"], vocab["<0xC3>"], vocab["<0xA9>"], vocab["<start_of_turn>"]]
    assert tokenizer.decode(ids) == "Hello\n\né<start_of_turn>"
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<bos>", "<eos>", "<pad>")


def test_the_gemma_download_is_refused_unless_its_sha256_is_the_pinned_one(tmp_path, monkeypatch):
    """prepare --model gemma3-270m: without its packages it says what to install; an assembled
    file whose digest is not the pinned one is deleted and refused, never converted."""
    import sys
    import types

    from specdec.config import GEMMA_PACKAGE
    from specdec.engine.models import loading
    from specdec.errors import ModelLoadError

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, GEMMA_PACKAGE, None)  # not installed
    with pytest.raises(ModelLoadError, match="make prepare-gemma"):
        loading.prepare_gemma()

    def assemble(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not the gemma file")
        return path

    fake = types.SimpleNamespace(MODEL_NAME="gemma-3-270m-q4_k_m.gguf", assemble=assemble)
    monkeypatch.setitem(sys.modules, GEMMA_PACKAGE, fake)
    monkeypatch.setattr(loading, "convert_gguf", lambda *a: pytest.fail("a file with the wrong sha256 was converted"))
    with pytest.raises(ModelLoadError, match="sha256"):
        loading.prepare_gemma()
    assert not (tmp_path / "gguf" / fake.MODEL_NAME).exists()
