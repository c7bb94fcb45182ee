"""Medusa heads (arXiv 2401.10774; FasterDecoding/Medusa `medusa_model.py`), trained here.

K heads read the target's last hidden state at position t (the output of its last decoder
layer, through the target's final norm) and head k guesses the token at t + 2 + k: the
target's own lm_head gives t + 1 (the root of the draft), the heads the tokens after it.
Each head is one residual block, h_k = h + SiLU(W_k h + b_k) (Medusa-1's ResBlock), and the
heads share one lm_head over a reduced draft vocabulary (the EAGLE-3 head's d2t / t2d
mapping): Medusa-1 gives each head a full-vocabulary lm_head, 49k x 576 here, which would
make four heads 4x the size and the draft cost of the target's own lm_head. Heads do not
see the draft tokens before theirs, so all K run in one pass.

Checkpoint: config.json (`medusa_num_heads`, `medusa_num_layers`, our `source_layer` and
`draft_vocab_size`) + model.safetensors with `medusa_head.{k}.0.linear.{weight,bias}`
(Medusa's names), `lm_head.weight`, `norm.weight`, `d2t`, `t2d`.
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
from specdec.errors import ModelLoadError
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
        if raw.get("medusa_num_layers", 1) != 1:
            raise ModelLoadError(f"Medusa heads with {raw['medusa_num_layers']} residual blocks per head are not supported (1 is)")
        return MedusaConfig(raw["hidden_size"], raw["vocab_size"], raw["draft_vocab_size"], raw["medusa_num_heads"],
                            raw["source_layer"], raw.get("rms_norm_eps", 1e-5))


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
        self.medusa_head = nn.ModuleList(nn.Sequential(ResBlock(H)) for _ in range(cfg.num_heads))
        self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
        self._register_vocabulary(cfg.draft_vocab_size, cfg.vocab_size)

    def forward(self, last_hidden: Tensor) -> Tensor:
        """[..., H] output of the target's last layer -> [K, ..., Vd] draft logits."""
        h = self.norm(last_hidden.float())
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


def load_medusa(heads_dir: Path, target_cfg: ModelConfig | None = None) -> MedusaHeads:
    heads_dir = Path(heads_dir)
    cfg_path, weights = heads_dir / "config.json", heads_dir / "model.safetensors"
    for path in (cfg_path, weights):
        if not path.is_file():
            raise ModelLoadError(f"missing file: {path}")
    cfg = MedusaConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    if target_cfg is not None and (cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size
                                   or not 0 <= cfg.source_layer < target_cfg.num_layers):
        raise ModelLoadError(f"Medusa heads {heads_dir} do not fit the target (hidden/vocab/layer mismatch)")
    heads = MedusaHeads(cfg)
    missing, unexpected = heads.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(weights)).items()},
                                                strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"Medusa checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return heads.eval()
