"""The native forward (kernels/forward_plan.c): a quantized target's whole forward in one C call.

The per-op forward (llama.py on the kernels' per-op entry points) stays the oracle: the native
forward runs the same kernels on the same rows in the same float order, so its logits and hidden
taps equal the per-op forward's bit for bit (tests/engine/test_native_forward.py, for every batch
shape the engine makes). What it removes is the overhead around them: one ctypes call and one
OpenMP parallel region a step instead of hundreds, no PyTorch operator and no allocation inside.

A plan is built once per model (ForwardPlan.of): the pointers of every weight, held with the
tensors they point into. It runs every family the quantized formats serve: Llama, Mistral (its
window is in the mask), Qwen2's biases, Qwen3's query/key norms, and Gemma 3's sandwich norms, GELU
gate, scaled embedding and local layers (their windowed mask and RoPE base). float32, bfloat16 and
CUDA keep the per-op path (`unsupported_reason` says why).
SPECDEC_NATIVE_FORWARD=0 turns it off (the per-op path serves, as before it existed).
"""
from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, Structure, c_float, c_int, c_long, c_size_t, c_void_p
from typing import Sequence

import torch
from torch import Tensor

from specdec.engine import kernels
from specdec.engine.kernels.int8 import PackedInt8

NATIVE_ENV = "SPECDEC_NATIVE_FORWARD"  # "0": the per-op path serves the quantized formats


class _PackedWeight(Structure):  # forward_plan.c's packed_weight (int8_linear.h)
    _fields_ = [("format", c_int), ("n", c_long), ("k", c_long), ("tiles", c_long), ("packed", c_void_p),
                ("column_scale", c_void_p), ("block_scale", c_void_p), ("block_offset", c_void_p)]


class _PlanLayer(Structure):
    _fields_ = [("attn_norm", c_void_p), ("mlp_norm", c_void_p), ("qkv_bias", c_void_p), ("o_bias", c_void_p),
                ("q_norm", c_void_p), ("k_norm", c_void_p), ("attn_out_norm", c_void_p), ("mlp_out_norm", c_void_p),
                ("local", c_long), ("wqkv", _PackedWeight), ("wo", _PackedWeight), ("w13", _PackedWeight), ("w2", _PackedWeight)]


class _Plan(Structure):
    _fields_ = [("isa", c_int), ("layers", c_long), ("hidden", c_long), ("heads", c_long), ("kv_heads", c_long),
                ("head_dim", c_long), ("intermediate", c_long), ("vocab", c_long), ("eps", c_float),
                ("embed_scale", c_float), ("attention_scale", c_float), ("gelu", c_int), ("embed", c_void_p),
                ("final_norm", c_void_p), ("rope_cos", c_void_p), ("rope_sin", c_void_p), ("rope_positions", c_long),
                ("local_cos", c_void_p), ("local_sin", c_void_p), ("local_positions", c_long), ("lm_head", _PackedWeight),
                ("layer", POINTER(_PlanLayer)), ("scratch", c_void_p), ("scratch_bytes", c_size_t)]


class _Step(Structure):
    _fields_ = [("T", c_long), ("B", c_long), ("N", c_long), ("C", c_long), ("tokens", c_void_p), ("positions", c_void_p),
                ("slot", c_void_p), ("column", c_void_p), ("token_of", c_void_p), ("num_new", c_void_p),
                ("seq_slot", c_void_p), ("mask", c_void_p), ("local_mask", c_void_p), ("k_cache", c_void_p), ("v_cache", c_void_p),
                ("s_layer", c_long), ("s_slot", c_long), ("s_head", c_long), ("s_col", c_long),
                ("logits_rows", c_long), ("logits_token", c_void_p), ("logits", c_void_p), ("taps", c_long),
                ("tap_layer", c_void_p), ("hidden", c_void_p)]


def enabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1") != "0"


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(module) -> tuple[_PackedWeight, PackedInt8]:
    w: PackedInt8 = module.weight
    return _PackedWeight(w.format, w.out_features, w.in_features, -(-w.out_features // 16), _ptr(w.packed),
                         _ptr(w.column_scale), _ptr(w.block_scale), _ptr(w.block_offset)), w


def unsupported_reason(model) -> str | None:
    """Why the plan cannot run this model's forward (None: it can)."""
    from specdec.engine.models.quantized import QuantizedLinear

    cfg = model.cfg
    if not model.batch_invariant:
        return "not a quantized weight format"
    if not kernels.available():
        return kernels.unavailable_reason()
    if model.embed.weight.device.type != "cpu" or model.embed.weight.dtype != torch.float32:
        return "the embedding is not float32 on the CPU"
    if cfg.kv_lora_rank or cfg.hidden_act not in ("silu", "gelu_tanh"):
        return f"{cfg.model_type}'s layers (latent attention, or a {cfg.hidden_act} gate) run per op"
    if any(t.dtype != torch.float32 for t in model.parameters()):
        return "a norm weight is not float32"
    linears = [model.lm_head] + [m for layer in model.layers for m in (layer.attn.wqkv, layer.attn.wo, layer.mlp.w13, layer.mlp.w2)]
    if not all(isinstance(m, QuantizedLinear) for m in linears):
        return "a linear layer is not quantized"
    if any(layer.mlp.w13.bias is not None or layer.mlp.w2.bias is not None for layer in model.layers) or model.lm_head.bias is not None:
        return "an MLP or lm_head bias"
    return None


class RopeTable:
    """cos and sin of every RoPE position, [positions, head_dim] (sin's first half negated), computed
    in fixed blocks of positions by llama.rope_tables: a position's values never depend on the batch
    it is looked up for, so the per-op forward and the plan read the same bits."""

    BLOCK = 1024

    def __init__(self, inv_freq: Tensor):
        self.inv_freq = inv_freq
        self.cos = self.sin = torch.empty(0, inv_freq.shape[0] * 2)

    def cover(self, positions: int) -> bool:
        """Grow to at least `positions` positions; True when the tables moved."""
        from specdec.engine.models.llama import rope_tables

        have = self.cos.shape[0]
        if positions <= have:
            return False
        blocks = [rope_tables(torch.arange(start, start + self.BLOCK)[None], self.inv_freq, torch.float32)
                  for start in range(have, -(-positions // self.BLOCK) * self.BLOCK, self.BLOCK)]
        self.cos = torch.cat([self.cos] + [c.view(self.BLOCK, -1) for c, _ in blocks]).contiguous()
        self.sin = torch.cat([self.sin] + [s.view(self.BLOCK, -1) for _, s in blocks]).contiguous()
        return True

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [*positions.shape, 1, head_dim] (llama.rope_tables' shape)."""
        self.cover(int(positions.max()) + 1 if positions.numel() else 0)
        flat = positions.reshape(-1)
        shape = (*positions.shape, 1, self.cos.shape[1])
        return self.cos.index_select(0, flat).view(shape), self.sin.index_select(0, flat).view(shape)


class ForwardPlan:
    """The pointers of one model's weights, laid out as forward_plan.c reads them, and the tensors
    they point into (held, so they live as long as the plan)."""

    def __init__(self, model, rope: RopeTable, local_rope: RopeTable | None = None):
        cfg = model.cfg
        self.model, self.rope, self.local_rope = model, rope, local_rope
        self._keep: list = []
        layers = (_PlanLayer * cfg.num_layers)()
        for i, block in enumerate(model.layers):
            attn, mlp = block.attn, block.mlp
            weights = [_weight(m) for m in (attn.wqkv, attn.wo, mlp.w13, mlp.w2)]
            norms = [attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm else [None, None]
            norms += [block.attn_out_norm.weight, block.mlp_out_norm.weight] if block.sandwich else [None, None]
            self._keep += [w for _, w in weights] + [block.attn_norm.weight, block.mlp_norm.weight, attn.wqkv.bias, attn.wo.bias]
            self._keep += norms
            layers[i] = _PlanLayer(_ptr(block.attn_norm.weight), _ptr(block.mlp_norm.weight), _ptr(attn.wqkv.bias),
                                   _ptr(attn.wo.bias), *(_ptr(t) for t in norms), int(i in model.local_layers),
                                   *(c for c, _ in weights))
        lm_head, lm_weight = _weight(model.lm_head)
        self._keep += [lm_weight, model.embed.weight, model.norm.weight, layers]
        scale = cfg.embed_scale
        self.plan = _Plan(lm_weight.isa, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.intermediate_size, cfg.vocab_size, cfg.rms_norm_eps, 0.0 if scale is None else scale,
                          cfg.head_dim ** -0.5, int(cfg.hidden_act == "gelu_tanh"), _ptr(model.embed.weight),
                          _ptr(model.norm.weight), None, None, 0, None, None, 0, lm_head,
                          ctypes.cast(layers, POINTER(_PlanLayer)), None, 0)
        self._library = kernels.native()

    @classmethod
    def of(cls, model, rope: RopeTable, local_rope: RopeTable | None = None) -> "ForwardPlan | None":
        return None if unsupported_reason(model) is not None else cls(model, rope, local_rope)

    def __del__(self):
        library = getattr(self, "_library", None)
        if library is not None:
            library.forward_plan_free(ctypes.byref(self.plan))

    def forward(self, batch, cache, tap_layers: Sequence[int], logits_rows: Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """Logits [B, max(logits_rows), V] (row b's last logits_rows[b] tokens' in [:logits_rows[b]],
        zeros after) and hidden taps [B, N, taps * H] (zeros at padding), as Transformer.forward's."""
        cfg = self.model.cfg
        B, N = batch.tokens.shape
        num_new = batch.num_new
        counts = torch.tensor(num_new, dtype=torch.long)
        padded = any(n != N for n in num_new)
        if padded:
            real = (torch.arange(N)[None, :] < counts[:, None]).view(-1)
            index = real.nonzero().squeeze(1)
            pick = lambda t: t.reshape(-1).index_select(0, index)  # noqa: E731
        else:
            index = None
            pick = lambda t: t.reshape(-1).contiguous()  # noqa: E731 (an expanded row's reshape is a stride-0 view)
        tokens, positions, columns = pick(batch.tokens), pick(batch.positions), pick(batch.write_index)
        slots = pick(batch.slots[:, None].expand(B, N))
        T = tokens.shape[0]
        if index is None:
            token_of = torch.arange(B * N, dtype=torch.int32)
        else:
            token_of = torch.full((B * N,), -1, dtype=torch.int32)
            token_of[index] = torch.arange(T, dtype=torch.int32)
        self.rope.cover(int(positions.max()) + 1)
        self.plan.rope_cos, self.plan.rope_sin = _ptr(self.rope.cos), _ptr(self.rope.sin)
        self.plan.rope_positions = self.rope.cos.shape[0]
        mask = batch.attn_mask[:, 0].contiguous()
        local_mask = None
        if self.local_rope is not None:  # Gemma 3's sliding-window layers: their own window and RoPE base
            from specdec.engine.models.llama import windowed

            self.local_rope.cover(int(positions.max()) + 1)
            self.plan.local_cos, self.plan.local_sin = _ptr(self.local_rope.cos), _ptr(self.local_rope.sin)
            self.plan.local_positions = self.local_rope.cos.shape[0]
            local_mask = windowed(batch, cfg.local_window).attn_mask[:, 0].contiguous()
        ends = counts.cumsum(0)
        width = max(logits_rows, default=0)
        wanted = [t for b, k in enumerate(logits_rows) for t in range(int(ends[b]) - k, int(ends[b]))]
        logits_token = torch.tensor(wanted, dtype=torch.long)
        logits = torch.empty(len(wanted), cfg.vocab_size, dtype=torch.float32)
        taps = torch.tensor(list(tap_layers), dtype=torch.long)
        hidden = torch.empty(T, len(tap_layers) * cfg.hidden_size, dtype=torch.float32) if len(tap_layers) else None
        k, v = cache.k, cache.v
        step = _Step(T, B, N, mask.shape[-1], _ptr(tokens), _ptr(positions), _ptr(slots), _ptr(columns), _ptr(token_of),
                     _ptr(counts), _ptr(batch.slots), _ptr(mask), _ptr(local_mask), _ptr(k), _ptr(v), k.stride(0), k.stride(1),
                     k.stride(2),
                     k.stride(3), len(wanted), _ptr(logits_token), _ptr(logits), len(tap_layers), _ptr(taps), _ptr(hidden))
        status = self._library.forward_plan_run(ctypes.byref(self.plan), ctypes.byref(step), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the native forward failed ({status}): {('', 'a path this CPU lacks', 'a bad shape', 'out of memory')[min(status, 3)]}")
        return self._placed(logits, logits_rows, width, B), self._unpacked(hidden, index, B, N)

    @staticmethod
    def _placed(logits: Tensor, logits_rows: Sequence[int], width: int, B: int) -> Tensor:
        if all(k == width for k in logits_rows):
            return logits.view(B, width, logits.shape[-1])
        out = logits.new_zeros(B * width, logits.shape[-1])
        at = torch.tensor([b * width + j for b, k in enumerate(logits_rows) for j in range(k)], dtype=torch.long)
        return out.index_copy_(0, at, logits).view(B, width, logits.shape[-1])

    @staticmethod
    def _unpacked(hidden: Tensor | None, index: Tensor | None, B: int, N: int) -> Tensor | None:
        if hidden is None:
            return None
        if index is None:
            return hidden.view(B, N, -1)
        return hidden.new_zeros(B * N, hidden.shape[-1]).index_copy_(0, index, hidden).view(B, N, -1)


def engine_info(model, weight_format: str) -> dict[str, str]:
    """How this target's forward runs, for the server's metrics and results: its weight format, the
    forward (native: one call a step; per-op) and the int8 kernel path ("none" without quantized weights)."""
    plan = model.native_plan()
    path = "none"
    if model.batch_invariant:
        from specdec.engine.kernels.int8 import ISA

        path = ISA.NAMES[model.lm_head.weight.isa]
    return {"weight_format": str(weight_format), "forward": "native" if plan is not None else "per-op", "kernel_path": path}
