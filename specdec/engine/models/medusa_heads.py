"""Medusa heads (arXiv 2401.10774; FasterDecoding/Medusa `medusa_model.py`), trained here.

K heads read the target's last hidden state at position t (the output of its last decoder
layer, through the target's final norm) and head k guesses the token at t + 2 + k: the
target's own lm_head gives t + 1 (the root of the draft), the heads the tokens after it.
Each head is one residual block, h_k = h + SiLU(W_k h + b_k) (Medusa-1's ResBlock), and the
heads share one lm_head over a reduced draft vocabulary (the EAGLE-3 head's d2t / t2d
mapping): Medusa-1 gives each head a full-vocabulary lm_head, 49k x 576 here, which would
make four heads 4x the size and the draft cost of the target's own lm_head. Heads do not
see the draft tokens before theirs, so all K run in one pass.

Checkpoints load in two layouts:
- ours: config.json (`medusa_num_heads`, `medusa_num_layers`, our `source_layer` and
  `draft_vocab_size`) + model.safetensors with `medusa_head.{k}.{j}.linear.{weight,bias}`
  (Medusa's names), `lm_head.weight`, `norm.weight`, `d2t`, `t2d`;
- the Medusa project's (FasterDecoding/Medusa, what TensorRT-LLM's converter reads):
  config.json (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`) +
  medusa_lm_head.safetensors (or .pt) with `{k}.{j}.linear.{weight,bias}` and each head's own
  full-vocabulary lm_head `{k}.{medusa_num_layers}.weight`; the heads read the base model's
  final hidden state, so the norm is the target's own final norm (read from its checkpoint).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specdec.config import ModelConfig
from specdec.errors import ConfigError, ModelLoadError
from specdec.engine.models.eagle3_head import DraftVocabulary
from specdec.engine.models.llama import Linear, RMSNorm


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int
    source_layer: int  # the target layer whose output the heads read (its last)
    rms_norm_eps: float = 1e-5
    num_layers: int = 1  # residual blocks per head
    own_lm_heads: bool = False  # the Medusa project's layout: a full-vocabulary lm_head per head

    @staticmethod
    def for_target(target: ModelConfig, num_heads: int, draft_vocab_size: int) -> "MedusaConfig":
        return MedusaConfig(target.hidden_size, target.vocab_size, draft_vocab_size, num_heads, target.num_layers - 1,
                            target.rms_norm_eps)

    def to_hf_dict(self) -> dict[str, Any]:
        return {"architectures": ["MedusaHeads"], "medusa_num_heads": self.num_heads, "medusa_num_layers": 1,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "source_layer": self.source_layer, "rms_norm_eps": self.rms_norm_eps}

    @staticmethod
    def from_hf_dict(raw: dict[str, Any]) -> "MedusaConfig":
        return MedusaConfig(raw["hidden_size"], raw["vocab_size"], raw["draft_vocab_size"], raw["medusa_num_heads"],
                            raw["source_layer"], raw.get("rms_norm_eps", 1e-5), _layers_per_head(raw))

    @staticmethod
    def for_medusa_project(raw: dict[str, Any], target: ModelConfig) -> "MedusaConfig":
        """The Medusa project's config.json, on this target (its last layer, its vocabulary)."""
        heads = raw.get("medusa_num_heads")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ConfigError("medusa_num_heads", f"must be an integer >= 1, got {heads!r}")
        return MedusaConfig(target.hidden_size, target.vocab_size, target.vocab_size, heads, target.num_layers - 1,
                            target.rms_norm_eps, _layers_per_head(raw), own_lm_heads=True)


def _layers_per_head(raw: dict[str, Any]) -> int:
    layers = raw.get("medusa_num_layers", 1)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ConfigError("medusa_num_layers", f"must be an integer >= 1, got {layers!r}")
    return layers


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = Linear(hidden, hidden, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x).float())


class MedusaHeads(DraftVocabulary):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.norm = RMSNorm(H, cfg.rms_norm_eps)  # a copy of the target's final norm
        self.medusa_head = nn.ModuleList(nn.Sequential(*(ResBlock(H) for _ in range(cfg.num_layers))) for _ in range(cfg.num_heads))
        if cfg.own_lm_heads:  # the Medusa project's: each head's own lm_head over the whole vocabulary
            self.head_lm_heads = nn.ModuleList(Linear(H, cfg.vocab_size, bias=False) for _ in range(cfg.num_heads))
        else:
            self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
        self._register_vocabulary(cfg.draft_vocab_size, cfg.vocab_size)
        if cfg.own_lm_heads:  # the draft vocabulary is the whole one
            self.set_vocabulary(torch.arange(cfg.vocab_size))

    def forward(self, last_hidden: Tensor) -> Tensor:
        """[..., H] output of the target's last layer -> [K, ..., Vd] draft logits."""
        h = self.norm(last_hidden.float())
        if self.cfg.own_lm_heads:
            return torch.stack([lm(head(h)).float() for head, lm in zip(self.medusa_head, self.head_lm_heads)])
        guesses = torch.stack([head(h) for head in self.medusa_head])  # [K, ..., H]
        # One lm_head GEMM over every head's rows: its weight (the heads' largest) is read once a
        # step, not once per head (4x less memory traffic at batch 1, where decoding is bandwidth bound).
        return self.lm_head(guesses.reshape(-1, guesses.shape[-1])).float().reshape(*guesses.shape[:-1], -1)


def save_medusa(heads: MedusaHeads, out_dir: Path, dtype: torch.dtype = torch.float16) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous() for k, v in heads.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(heads.cfg.to_hf_dict(), indent=2))


MEDUSA_PROJECT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def medusa_project_file(heads_dir: Path) -> Path | None:
    """The Medusa project's weights file in heads_dir, if the heads are in its layout."""
    return next((Path(heads_dir) / name for name in MEDUSA_PROJECT_FILES if (Path(heads_dir) / name).is_file()), None)


def heads_config(heads_dir: Path, target_cfg: ModelConfig) -> MedusaConfig:
    """The heads' config in either layout (the Medusa project's is completed from the target)."""
    cfg_path = Path(heads_dir) / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"missing file: {cfg_path}")
    raw = json.loads(cfg_path.read_text())
    if medusa_project_file(heads_dir) is not None:
        return MedusaConfig.for_medusa_project(raw, target_cfg)
    return MedusaConfig.from_hf_dict(raw)


def load_medusa(heads_dir: Path, target_cfg: ModelConfig | None = None, target_dir: Path | None = None) -> MedusaHeads:
    """Heads in our layout, or in the Medusa project's (then target_cfg and target_dir are
    needed: the heads' norm is the target's final norm, read from its checkpoint)."""
    heads_dir = Path(heads_dir)
    project = medusa_project_file(heads_dir)
    if project is not None:
        if target_cfg is None or target_dir is None:
            raise ModelLoadError(f"{heads_dir}: heads in the Medusa project's layout need their target (config and checkpoint)")
        return _load_medusa_project(heads_dir, project, target_cfg, target_dir)
    cfg_path, weights = heads_dir / "config.json", heads_dir / "model.safetensors"
    for path in (cfg_path, weights):
        if not path.is_file():
            raise ModelLoadError(f"missing file: {path}")
    cfg = MedusaConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    if target_cfg is not None:
        for key, ours, theirs in (("hidden_size", cfg.hidden_size, target_cfg.hidden_size), ("vocab_size", cfg.vocab_size, target_cfg.vocab_size)):
            if ours != theirs:
                raise ConfigError(key, f"the heads have {ours}, the target {theirs}")
        if not 0 <= cfg.source_layer < target_cfg.num_layers:
            raise ConfigError("source_layer", f"must be a layer of the target's {target_cfg.num_layers}, got {cfg.source_layer}")
    return _filled(MedusaHeads(cfg), load_file(str(weights)))


def _load_medusa_project(heads_dir: Path, weights: Path, target_cfg: ModelConfig, target_dir: Path) -> MedusaHeads:
    from specdec.engine.models.loading import load_target_tensor

    cfg = heads_config(heads_dir, target_cfg)
    sd = load_file(str(weights)) if weights.suffix == ".safetensors" else torch.load(weights, map_location="cpu", weights_only=True)
    L = cfg.num_layers
    block, lm = sd.get("0.0.linear.weight"), sd.get(f"0.{L}.weight")
    if block is not None and block.shape[-1] != target_cfg.hidden_size:
        raise ConfigError("hidden_size", f"the heads have {block.shape[-1]}, the target {target_cfg.hidden_size}")
    if lm is not None and lm.shape[0] != target_cfg.vocab_size:
        raise ConfigError("vocab_size", f"the heads' lm_head has {lm.shape[0]} rows, the target's vocabulary {target_cfg.vocab_size}")
    own = {"norm.weight": load_target_tensor(target_dir, "model.norm.weight")}
    for k in range(cfg.num_heads):
        for j in range(L):
            for part in ("weight", "bias"):
                if f"{k}.{j}.linear.{part}" in sd:
                    own[f"medusa_head.{k}.{j}.linear.{part}"] = sd[f"{k}.{j}.linear.{part}"]
        if f"{k}.{L}.weight" in sd:
            own[f"head_lm_heads.{k}.weight"] = sd[f"{k}.{L}.weight"]
    heads = MedusaHeads(cfg)
    own.update({"d2t": heads.d2t, "t2d": heads.t2d})
    unexpected = sorted(set(sd) - {f"{k}.{j}.linear.{part}" for k in range(cfg.num_heads) for j in range(L) for part in ("weight", "bias")}
                        - {f"{k}.{L}.weight" for k in range(cfg.num_heads)})
    if unexpected:
        raise ModelLoadError(f"Medusa checkpoint {weights}: unexpected weights {unexpected[:4]} (medusa_num_heads "
                             f"{cfg.num_heads}, medusa_num_layers {L})")
    return _filled(heads, own)


def _filled(heads: MedusaHeads, sd: dict[str, Tensor]) -> MedusaHeads:
    missing, unexpected = heads.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"Medusa checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return heads.eval()
