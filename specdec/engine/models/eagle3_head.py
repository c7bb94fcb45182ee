"""The EAGLE-3 draft head (arXiv 2503.01840; SafeAILab/EAGLE `eagle/traineagle3/cnets.py`).

taps of 3 target layers [.., 3H] --fc--> H ("fused"), or the head's own previous output (H)
x = [input_layernorm(embed(token)); hidden_norm(hidden)]        (2H: embedding first)
h = hidden + attn(x)   (q/k/v from 2H)
h = h + mlp(post_attention_layernorm(h))
draft logits = lm_head(norm(h)) over a reduced vocabulary; target id = draft id + d2t[draft id]

A pair (hidden of position t, embedding of token t+1) predicts token t+2. The embedding
matrix is the target's (frozen, not stored in the checkpoint). Checkpoints load in two
layouts: the research / SpecForge one (config.json with `eagle_config`; weights `fc`,
`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), which is what we save, and vLLM's
`speculators` one (config.json with `speculators_model_type: eagle3`,
`transformer_layer_config`, `speculators_config`; the decoder layer's weights under
`layers.0.*`), which `export_speculators` writes. norm_before_residual (speculators'): the
residual around the attention starts from hidden_norm(hidden) instead of hidden. EAGLE-3.1's
flags (speculators'): norm_before_fc, one RMSNorm over the concatenated taps before fc
(`input_norm.weight`, ones when absent, as speculators loads it); fc_norm, one RMSNorm per tap
before the concatenation (`fc_norm.{i}.weight`; exclusive with norm_before_fc); norm_output,
the hidden carried to the next draft step is norm(h), not h (the logits are lm_head(norm(h))
either way).
More than one decoder layer (speculators' `num_hidden_layers` > 1; research layout
`layers.{i}.*` for i >= 1 beside `midlayer.*`): the first reads [embedding; hidden] as above,
the others are plain Llama decoder layers over its output, each with its own KV cache layer;
the hidden carried to the next draft step and the logits come from the last one.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specdec.config import ModelConfig
from specdec.errors import ConfigError, ModelLoadError
from specdec.engine.kv_cache import KVCache
from specdec.engine.models.llama import (
    MLP, Attention, Block, ForwardBatch, Linear, RMSNorm, apply_rope, last_tokens, onednn_supports, prepare_step, rope_inv_freq, rope_tables,
)


# The speculators release whose EAGLE-3 format export_speculators writes (PyPI `speculators`).
SPECULATORS_VERSION = "0.9.0"
# speculators' name for the decoder layer's weights -> the research layout's
SPECULATORS_LAYER, RESEARCH_LAYER = "layers.0.", "midlayer."
# EAGLE-3.1's norms (speculators' config keys), off in EAGLE-3
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tap_layers: tuple[int, ...] = ()  # target layers whose outputs are concatenated
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden) (speculators' flag)
    norm_before_fc: bool = False  # EAGLE-3.1: RMSNorm over the concatenated taps before fc
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm per tap before the concatenation
    norm_output: bool = False  # EAGLE-3.1: the next step reads norm(h)
    num_hidden_layers: int = 1  # decoder layers: the EAGLE-3 layer, then plain ones over its output

    @staticmethod
    def for_target(target: ModelConfig, draft_vocab_size: int, tap_layers: tuple[int, ...] | None = None) -> "Eagle3Config":
        return Eagle3Config(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads, head_dim=target.head_dim,
            vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, rope_scaling=dict(target.rope_scaling) if target.rope_scaling else None,
            max_position_embeddings=target.max_position_embeddings,
            tap_layers=tuple(tap_layers or target.eagle3_tap_layers()),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The published EAGLE-3 config.json (LlamaForCausalLMEagle3) plus our tap layers."""
        d = asdict(self)
        taps = d.pop("tap_layers")
        for flag in ("norm_before_residual", *EAGLE31_FLAGS):  # the research layout's meaning without the key
            if not d[flag]:
                d.pop(flag)
        d.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                 eagle_config={"eagle_aux_hidden_state_layer_ids": list(taps)})
        return d

    def to_speculators_dict(self, verifier: str | None = None) -> dict[str, Any]:
        """vLLM speculators' config.json (Eagle3SpeculatorConfig) for this head."""
        layer = {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        }
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual, "norm_before_fc": self.norm_before_fc, "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(self.tap_layers),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0,
                                      "verifier_accept_k": 1}],
                "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
            },
        }

    @staticmethod
    def from_speculators_dict(raw: dict[str, Any], target: ModelConfig | None = None) -> "Eagle3Config":
        """A speculators-format config (speculators_model_type eagle3). Flags this head does
        not implement are refused by their key, never ignored."""
        if raw.get("speculators_model_type") != "eagle3":
            raise ConfigError("speculators_model_type", f"this loader reads eagle3 heads, got {raw.get('speculators_model_type')!r}")
        if raw.get("norm_before_fc") and raw.get("fc_norm"):
            raise ConfigError("fc_norm", "norm_before_fc and fc_norm are exclusive (one norm over the taps, or one per tap)")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ConfigError("transformer_layer_config", "is required (the draft decoder layer's config)")
        target_hidden = raw.get("target_hidden_size")
        if target_hidden is not None and target_hidden != layer.get("hidden_size"):
            raise ConfigError("target_hidden_size", f"a head wider or narrower than its target ({target_hidden} vs "
                                                    f"{layer.get('hidden_size')}) is not implemented")
        return Eagle3Config._from_dicts(layer, raw, raw.get("eagle_aux_hidden_state_layer_ids"), target)

    @staticmethod
    def _from_dicts(layer: dict[str, Any], raw: dict[str, Any], taps: Sequence[int] | None,
                    target: ModelConfig | None) -> "Eagle3Config":
        """layer: the decoder layer's shape keys (the whole config in the research layout);
        raw: the config's top level; taps: its aux layer ids (None: the target's default)."""
        if not taps:
            if target is None:
                raise ConfigError("eagle_aux_hidden_state_layer_ids", "is required without a target")
            taps = target.eagle3_tap_layers()
        heads = layer["num_attention_heads"]
        layers = layer.get("num_hidden_layers", 1)
        if not isinstance(layers, int) or layers < 1:
            key = "transformer_layer_config.num_hidden_layers" if layer is not raw else "num_hidden_layers"
            raise ConfigError(key, f"must be a positive integer, got {layers!r}")
        return Eagle3Config(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or layer["hidden_size"] // heads, vocab_size=layer["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or layer["vocab_size"], rms_norm_eps=layer.get("rms_norm_eps", 1e-5),
            rope_theta=layer.get("rope_theta", 10000.0), rope_scaling=layer.get("rope_scaling"),
            max_position_embeddings=layer.get("max_position_embeddings", 2048), tap_layers=tuple(taps),
            norm_before_residual=bool(raw.get("norm_before_residual", False)), num_hidden_layers=layers,
            **{flag: bool(raw.get(flag, False)) for flag in EAGLE31_FLAGS},
        )

    @staticmethod
    def from_config_file(raw: dict[str, Any], target: ModelConfig | None = None) -> "Eagle3Config":
        """Either layout's config.json."""
        if "speculators_model_type" in raw:
            return Eagle3Config.from_speculators_dict(raw, target)
        return Eagle3Config.from_hf_dict(raw, target)

    def check_fits(self, target: ModelConfig, speculators: bool) -> None:
        """A head made for another target is refused, naming the key that differs."""
        prefix = "transformer_layer_config." if speculators else ""
        for key, ours, theirs in (("hidden_size", self.hidden_size, target.hidden_size), ("vocab_size", self.vocab_size, target.vocab_size)):
            if ours != theirs:
                raise ConfigError(prefix + key, f"the head has {ours}, the target {theirs}")
        if not self.tap_layers or any(not 0 <= layer < target.num_layers for layer in self.tap_layers):
            key = "eagle_aux_hidden_state_layer_ids" if speculators else "eagle_config.eagle_aux_hidden_state_layer_ids"
            raise ConfigError(key, f"must be layers of the target's {target.num_layers}, got {list(self.tap_layers)}")

    @staticmethod
    def from_hf_dict(raw: dict[str, Any], target: ModelConfig | None = None) -> "Eagle3Config":
        """The research / SpecForge config.json (shape keys at the top level)."""
        return Eagle3Config._from_dicts(raw, raw, (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), target)

    def as_model_config(self) -> ModelConfig:
        """The shapes Attention / MLP / RMSNorm take."""
        return ModelConfig(
            model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_hidden_layers, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False, qkv_bias=False, rope_scaling=self.rope_scaling,
        )


class DraftVocabulary(nn.Module):
    """A reduced output vocabulary (the published EAGLE-3 buffers): draft id d is target id
    d + d2t[d]; t2d marks the target ids the drafter can propose. The EAGLE-3 head and the
    Medusa heads share it."""

    def _register_vocabulary(self, draft_vocab_size: int, vocab_size: int) -> None:
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))

    @property
    def draft_to_target(self) -> Tensor:
        """[Vd] target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocabulary(self, vocab_ids: Tensor) -> None:
        """vocab_ids: [Vd] ascending target ids."""
        self.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
        self.t2d.zero_()
        self.t2d[vocab_ids] = True


class Eagle3Head(DraftVocabulary):
    def __init__(self, cfg: Eagle3Config, embed: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        mcfg = cfg.as_model_config()
        H = cfg.hidden_size
        self.embed = embed  # the target's, frozen
        self.fc = Linear(len(cfg.tap_layers) * H, H, bias=False)
        self.input_norm = RMSNorm(len(cfg.tap_layers) * H, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in cfg.tap_layers) if cfg.fc_norm else None
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.attn = Attention(mcfg, 0, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(mcfg)
        # Decoder layers 1.. (num_hidden_layers > 1): plain Llama layers, cache layers 1..
        self.layers = nn.ModuleList(Block(mcfg, i) for i in range(1, cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
        self._register_vocabulary(cfg.draft_vocab_size, cfg.vocab_size)
        self.register_buffer("inv_freq", rope_inv_freq(mcfg), persistent=False)

    def new_cache(self, max_slots: int, max_seq_len: int, max_new_per_step: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_hidden_layers, max_slots, c.num_key_value_heads, max_seq_len, c.head_dim, max_new_per_step,
                       dtype=torch.float32, device=self.d2t.device)

    def fuse(self, hidden: Tensor) -> Tensor:
        """Target taps (3H) go through fc (after EAGLE-3.1's norms, when on); the head's own
        outputs (H) pass as they are."""
        if hidden.shape[-1] == self.cfg.hidden_size:
            return hidden
        if self.input_norm is not None:
            hidden = self.input_norm(hidden)
        if self.fc_norm is not None:
            hidden = torch.cat([norm(tap) for norm, tap in zip(self.fc_norm, hidden.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(hidden).float()

    def _mix(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        emb = self.embed(tokens).float()
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)

    def _residual(self, hidden: Tensor, attn_out: Tensor) -> Tensor:
        h = (self.hidden_norm(hidden) if self.cfg.norm_before_residual else hidden) + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)).float()

    def _carry(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(the hidden the next draft step reads, draft logits) of the layer's output h."""
        normed = self.norm(h)
        return (normed if self.cfg.norm_output else h), self.lm_head(normed).float()

    @torch.inference_mode()
    def forward(self, hidden: Tensor, batch: ForwardBatch, cache: KVCache) -> tuple[Tensor, Tensor]:
        """hidden: [B, N, 3H or H]; batch.tokens: the paired next tokens. Returns the
        output hidden [B, N, H] (input of the next draft step) and draft logits [B, N, Vd]."""
        hidden = self.fuse(hidden.float())
        step = prepare_step(batch, self.inv_freq, torch.float32)
        h = self._residual(hidden, self.attn(self._mix(hidden, batch.tokens), step, cache).float())
        return self._carry(self._upper_layers(h, step, cache))

    def _upper_layers(self, h: Tensor, step, cache: KVCache) -> Tensor:
        for block in self.layers:
            h = block(h, step, cache).float()
        return h

    @torch.inference_mode()
    def absorb(self, rows: Sequence[Tensor], batch: ForwardBatch, cache: KVCache) -> tuple[Tensor, Tensor]:
        """Catch up on committed pairs (a prompt, or the tokens a step accepted): the same
        pass as forward, but only each row's last position's hidden [B, H] and draft logits
        [B, Vd] come out, the rows' real tokens run packed (no matmul on padding), and the
        draft vocabulary's projection runs once per row instead of once per pair.
        rows[b]: [n_b, 3H or H] the taps paired with row b's tokens in batch."""
        step = prepare_step(batch, self.inv_freq, torch.float32, pack=True)
        packing, tokens = step.packing, batch.tokens
        if packing is not None:  # row-major real tokens: the rows' taps one after another
            hidden, tokens = torch.cat(list(rows)).float(), packing.pack(tokens)
        else:
            hidden = torch.stack(list(rows)).float()  # equal lengths
        hidden = self.fuse(hidden)
        h = self._residual(hidden, self.attn(self._mix(hidden, tokens), step, cache).float())
        return self._carry(last_tokens(self._upper_layers(h, step, cache), batch, packing))

    # ---- training: training-time test (TTT) -------------------------------------------
    def ttt_forward(self, taps: Tensor, next_tokens: Tensor, steps: int) -> list[Tensor]:
        """Unroll the head `steps` times on its own outputs over whole sequences, as drafting
        does. taps: [B, T, 3H] target features at positions t; next_tokens: [B, T + steps]
        tokens x_{t+1}... Step k at position t pairs the step k-1 output with the embedding
        of x_{t+k+1}, sits at RoPE position t+k, and attends to the step-0 keys of positions
        <= t (the committed prefix) plus its own keys of steps 1..k at t (its draft path).
        Returns the draft logits [B, T, Vd] of each step (step k predicts x_{t+k+2})."""
        B, T, _ = taps.shape
        hidden = self.fuse(taps)
        positions = torch.arange(T, device=taps.device)[None].expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=taps.device).tril()
        # per decoder layer: the keys and values of each step so far
        keys: list[list[Tensor]] = [[] for _ in range(self.cfg.num_hidden_layers)]
        values: list[list[Tensor]] = [[] for _ in range(self.cfg.num_hidden_layers)]
        outputs = []
        for k in range(steps):
            x = self._mix(hidden, next_tokens[:, k : k + T])
            rope = (positions + k, self.inv_freq)
            h = self._residual(hidden, self._ttt_attention(self.attn, x, rope, causal, keys[0], values[0]))
            for i, block in enumerate(self.layers, start=1):
                h = h + self._ttt_attention(block.attn, block.attn_norm(h), rope, causal, keys[i], values[i])
                h = h + block.mlp(block.mlp_norm(h))
            hidden, logits = self._carry(h)
            outputs.append(logits)
        return outputs

    @staticmethod
    def _ttt_attention(a: Attention, x: Tensor, rope: tuple[Tensor, Tensor], causal: Tensor, keys: list[Tensor],
                       values: list[Tensor]) -> Tensor:
        """One layer's attention at one TTT step: the step-0 keys of positions <= t (appended
        at step 0) plus this layer's keys of steps 1..k at t (appended here). rope: (RoPE
        positions, inv_freq); the tables take the projection's dtype (bfloat16 under autocast)."""
        B, T, _ = x.shape
        h_heads, kvh, hd = a.n_heads, a.n_kv, a.hd
        group = h_heads // kvh
        qkv = a.wqkv(x).view(B, T, h_heads + 2 * kvh, hd)
        qk = apply_rope(qkv[:, :, : h_heads + kvh], *rope_tables(*rope, qkv.dtype))
        q = qk[:, :, :h_heads].transpose(1, 2)  # [B, h, T, hd]
        keys.append(qk[:, :, h_heads:].transpose(1, 2).repeat_interleave(group, dim=1))  # [B, h, T, hd]
        values.append(qkv[:, :, h_heads + kvh :].transpose(1, 2).repeat_interleave(group, dim=1))
        scale = 1.0 / math.sqrt(hd)
        prefix = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
        prefix = prefix.masked_fill(~causal, float("-inf"))
        diag = [((q * kk).sum(-1) * scale)[..., None] for kk in keys[1:]]  # [B, h, T, 1] each
        probs = torch.softmax(torch.cat([prefix, *diag], dim=-1), dim=-1)
        out = probs[..., :T] @ values[0]
        for j, vv in enumerate(values[1:]):
            out = out + probs[..., T + j : T + j + 1] * vv
        return a.wo(out.transpose(1, 2).reshape(B, T, h_heads * hd))

    # ---- checkpoints in the published layout ---------------------------------------------
    def published_state_dict(self) -> dict[str, Tensor]:
        m = RESEARCH_LAYER
        upper = {}
        for i, block in enumerate(self.layers, start=1):
            upper.update(self._decoder_weights(f"layers.{i}.", block.attn_norm, block.attn, block.mlp_norm, block.mlp))
        return {
            "fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight,
            "d2t": self.d2t, "t2d": self.t2d, **self._eagle31_norms(), m + "hidden_norm.weight": self.hidden_norm.weight,
            **self._decoder_weights(m, self.input_layernorm, self.attn, self.post_attention_layernorm, self.mlp), **upper,
        }

    def _decoder_weights(self, prefix: str, input_norm: RMSNorm, attn: Attention, post_norm: RMSNorm, mlp: MLP) -> dict[str, Tensor]:
        """One decoder layer's weights under Llama's names (q/k/v and gate/up split)."""
        c = self.cfg
        q, k, v = attn.wqkv.weight.split(
            [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.num_key_value_heads * c.head_dim]
        )
        gate, up = mlp.w13.weight.chunk(2)
        return {
            prefix + "input_layernorm.weight": input_norm.weight, prefix + "post_attention_layernorm.weight": post_norm.weight,
            prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k, prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": attn.wo.weight, prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up, prefix + "mlp.down_proj.weight": mlp.w2.weight,
        }

    def _eagle31_norms(self) -> dict[str, Tensor]:
        norms = {} if self.input_norm is None else {"input_norm.weight": self.input_norm.weight}
        for i, norm in enumerate(self.fc_norm or ()):
            norms[f"fc_norm.{i}.weight"] = norm.weight
        return norms

    def load_published(self, sd: dict[str, Tensor]) -> None:
        def take(name: str) -> Tensor:
            if name not in sd:
                raise ModelLoadError(f"EAGLE-3 checkpoint lacks {name!r}")
            return sd[name]

        def decoder(prefix: str, own_prefix: str, input_norm: str, post_norm: str) -> dict[str, Tensor]:
            """One decoder layer's Llama-named weights -> ours (q|k|v and gate|up fused)."""
            return {
                own_prefix + input_norm: take(prefix + "input_layernorm.weight"),
                own_prefix + post_norm: take(prefix + "post_attention_layernorm.weight"),
                own_prefix + "attn.wqkv.weight": torch.cat([take(prefix + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                own_prefix + "attn.wo.weight": take(prefix + "self_attn.o_proj.weight"),
                own_prefix + "mlp.w13.weight": torch.cat([take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")]),
                own_prefix + "mlp.w2.weight": take(prefix + "mlp.down_proj.weight"),
            }

        m = RESEARCH_LAYER
        own = {
            "fc.weight": take("fc.weight"), "norm.weight": take("norm.weight"), "lm_head.weight": take("lm_head.weight"),
            "hidden_norm.weight": take(m + "hidden_norm.weight"), "d2t": take("d2t").long(), "t2d": take("t2d").bool(),
            **decoder(m, "", "input_layernorm.weight", "post_attention_layernorm.weight"),
        }
        for i in range(1, self.cfg.num_hidden_layers):
            own.update(decoder(f"layers.{i}.", f"layers.{i - 1}.", "attn_norm.weight", "mlp_norm.weight"))
        if self.input_norm is not None:  # speculators leaves it out when it was never trained (ones)
            own["input_norm.weight"] = sd.get("input_norm.weight", torch.ones_like(self.input_norm.weight))
        own.update({f"fc_norm.{i}.weight": take(f"fc_norm.{i}.weight") for i in range(len(self.fc_norm or ()))})
        beyond = sorted(k for k in sd if k.startswith("layers.") and int(k.split(".")[1]) >= self.cfg.num_hidden_layers)
        if beyond:  # weights of layers the config does not count would be dropped without a word
            raise ConfigError("num_hidden_layers", f"the config counts {self.cfg.num_hidden_layers} decoder layers, the weights "
                                                   f"have more ({beyond[0]})")
        missing, unexpected = self.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in own.items()}, strict=False)
        missing = [k for k in missing if not k.startswith("embed.")]
        if missing or unexpected:
            raise ModelLoadError(f"EAGLE-3 checkpoint mismatch: missing {missing}, unexpected {unexpected}")


def draft_weights(head: nn.Module, draft_dtype: str) -> nn.Module:
    """Weight-only low precision for drafting (engine.draft_dtype); norms and activations stay
    float32, and the target's output, hence losslessness, does not depend on it.
    - int8: the linears on the project's int8 kernels (one scale per 32 inputs, as the target's
      int8). A draft pass is bound by the bytes it streams (~10M weights per token), so this
      halves bfloat16's; measured side by side, the same head's c=1 speed rose ~10% at every
      shape with its acceptance unchanged (docs/methods.md, `engine.draft_dtype`; make bench-tree-shapes).
    - bfloat16: oneDNN's bf16 kernels (on CPU only where oneDNN has them; float32 otherwise)."""
    on_cpu = next(head.parameters()).device.type == "cpu"
    if draft_dtype == "int8":
        from specdec.engine import kernels
        from specdec.engine.models.quantized import quantize_linears

        if not on_cpu or not kernels.available():
            reason = kernels.unavailable_reason() if on_cpu else "they run on CPU"
            raise ConfigError("draft_dtype", f"int8 needs the project's compiled CPU kernels ({reason}); use bfloat16")
        return quantize_linears(head)
    dtype = getattr(torch, draft_dtype)
    if dtype == torch.bfloat16 and on_cpu and not onednn_supports(dtype):
        return head
    for module in head.modules():
        if isinstance(module, Linear):
            module.to(dtype)
    return head


def save_eagle3(head: Eagle3Head, out_dir: Path, dtype: torch.dtype = torch.float16, extra: dict | None = None) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous() for k, v in head.published_state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({**head.cfg.to_hf_dict(), **(extra or {})}, indent=2))


def _read_head(head_dir: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json, weights) of a head directory, in whichever layout it was saved."""
    cfg_path = head_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"missing file: {cfg_path}")
    weights = head_dir / "model.safetensors"
    if weights.is_file():
        sd = load_file(str(weights))
    elif (head_dir / "pytorch_model.bin").is_file():
        sd = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"no model.safetensors or pytorch_model.bin in {head_dir}")
    return json.loads(cfg_path.read_text()), sd


def _research_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """speculators' weight names -> the research layout's (its embed_tokens is the target's: dropped)."""
    return {(RESEARCH_LAYER + k[len(SPECULATORS_LAYER):] if k.startswith(SPECULATORS_LAYER) else k): v
            for k, v in sd.items() if k != "embed_tokens.weight"}


def load_eagle3(head_dir: Path, target_embed: nn.Embedding, target_cfg: ModelConfig | None = None) -> Eagle3Head:
    """Load a head in either layout (research / SpecForge, or vLLM speculators); one made
    for another target is refused naming the key that differs."""
    head_dir = Path(head_dir)
    raw, sd = _read_head(head_dir)
    speculators = "speculators_model_type" in raw
    cfg = Eagle3Config.from_config_file(raw, target_cfg)
    if target_cfg is not None:
        cfg.check_fits(target_cfg, speculators)
    head = Eagle3Head(cfg, target_embed)
    head.load_published(_research_names(sd) if speculators else sd)
    return head.eval()


def export_speculators(head_dir: Path, out_dir: Path, verifier: str | None = None) -> Path:
    """Write a head (either layout) in vLLM speculators' format: its config.json, and the same
    tensors bit for bit under speculators' names (the decoder layer as layers.0.*)."""
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    raw, sd = _read_head(head_dir)
    cfg = Eagle3Config.from_config_file(raw)
    tensors = {(SPECULATORS_LAYER + k[len(RESEARCH_LAYER):] if k.startswith(RESEARCH_LAYER) else k): v.contiguous()
               for k, v in _research_names(sd).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg.to_speculators_dict(verifier), indent=2) + "\n")
    return out_dir


def mapped_logits(head: Eagle3Head, draft_logits: Tensor) -> Tensor:
    """[..., Vd] draft logits -> [..., V] target-vocab logits (-inf outside the draft vocab)."""
    full = torch.full((*draft_logits.shape[:-1], head.cfg.vocab_size), float("-inf"), device=draft_logits.device)
    full[..., head.draft_to_target] = draft_logits
    return full


def draft_log_probs(draft_logits: Tensor) -> Tensor:
    return F.log_softmax(draft_logits.float(), dim=-1)
