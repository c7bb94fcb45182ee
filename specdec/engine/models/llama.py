"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) with a batched ragged,
tree-masked forward over a slot KV cache. In the style of gpt-fast: one file, plain tensors.

One forward takes B sequences; sequence b brings n_b new tokens with their own RoPE
positions and an ancestor mask among them (a draft tree; a chain is the causal special
case), and attends fully to its cached prefix. Rows are padded to N = max n_b for
attention only: when rows differ in length (a wave of prompts, trees of different sizes,
prompt chunks beside draft trees) the projections and the MLP run on the packed sum(n_b)
real tokens, so padding costs no matmul work.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.config import GEMMA3, SLIDING_ATTENTION, ModelConfig
from specdec.engine import kernels
from specdec.engine.kernels import invariant_attention
from specdec.engine.kv_cache import KVCache
from specdec.engine.models import native_forward
from specdec.engine.models.native_forward import RopeTable


@dataclass
class ForwardBatch:
    tokens: Tensor  # [B, N] int64, padded with 0
    positions: Tensor  # [B, N] int64 RoPE positions (prefix_len + depth in the tree)
    slots: Tensor  # [B] int64 KV-cache slot per row
    write_index: Tensor  # [B, N] int64 cache column of each new token (prefix_len + j)
    attn_mask: Tensor  # [B, 1, N, C] bool, True = may attend; C = max(prefix_len + N)
    num_new: list[int]  # n_b per row
    slot_start: int | None  # slots are slot_start..slot_start+B-1 -> the cache is a view
    fresh_prompts: bool = False  # every row a causal chain from position 0 (a prefill wave)

    @property
    def context_len(self) -> int:
        return self.attn_mask.shape[-1]


def build_batch(
    slots: Sequence[int],
    prefix_lens: Sequence[int],
    tokens: Sequence[Sequence[int]],
    depths: Sequence[Sequence[int]] | None = None,
    tree_masks: Sequence[Tensor | None] | None = None,
    sliding_window: int | None = None,
    device: str | torch.device = "cpu",
) -> ForwardBatch:
    """Pack ragged rows. depths[b][j] is token j's depth (RoPE offset past the prefix);
    tree_masks[b] is [n_b, n_b] bool ancestor-or-self mask. None means a causal chain."""
    B = len(slots)
    n = [len(t) for t in tokens]
    N = max(n)
    prefix = torch.tensor(prefix_lens, dtype=torch.long)
    tok = torch.zeros(B, N, dtype=torch.long)
    depth = torch.zeros(B, N, dtype=torch.long)
    # Padding rows attend to themselves only, so no softmax row is empty (NaN).
    new_mask = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)  # [B, N, N]
    causal = torch.ones(N, N, dtype=torch.bool).tril_()
    for b in range(B):
        nb = n[b]
        tok[b, :nb] = torch.as_tensor(tokens[b], dtype=torch.long)
        if depths is None or depths[b] is None:
            depth[b, :nb] = torch.arange(nb)
        else:
            depth[b, :nb] = torch.as_tensor(depths[b], dtype=torch.long)
        tm = None if tree_masks is None else tree_masks[b]
        new_mask[b, :nb, :nb] = causal[:nb, :nb] if tm is None else tm
    positions = prefix[:, None] + depth
    write_index = prefix[:, None] + torch.arange(N)[None, :]
    C = int(prefix.max()) + N
    cols = torch.arange(C)
    mask = (cols[None, None, :] < prefix[:, None, None]).expand(B, N, C).clone()  # the cached prefix
    mask.scatter_(2, write_index[:, None, :].expand(B, N, N), new_mask)  # the new tokens
    slot_t = torch.tensor(slots, dtype=torch.long)
    contiguous = all(s == slots[0] + i for i, s in enumerate(slots))
    batch = ForwardBatch(
        tokens=tok.to(device),
        positions=positions.to(device),
        slots=slot_t.to(device),
        write_index=write_index.to(device),
        attn_mask=mask[:, None].to(device),
        num_new=n,
        slot_start=slots[0] if contiguous else None,
        fresh_prompts=not any(prefix_lens) and depths is None and tree_masks is None,
    )
    return windowed(batch, sliding_window) if sliding_window else batch


def windowed(batch: ForwardBatch, window: int) -> ForwardBatch:
    """The batch with each row attending only within `window` positions of its own (a
    sliding-window layer): a column's position is its cache column for the committed
    context, its node's position for the new tokens (tree siblings share one)."""
    B, C = batch.attn_mask.shape[0], batch.attn_mask.shape[-1]
    col_pos = torch.arange(C, device=batch.positions.device)[None, :].expand(B, C).clone()
    col_pos.scatter_(1, batch.write_index, batch.positions)
    allowed = batch.attn_mask[:, 0] & (col_pos[:, None, :] > batch.positions[:, :, None] - window)
    return dataclasses.replace(batch, attn_mask=allowed[:, None], fresh_prompts=False)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling:  # Llama 3.1 frequency-dependent scaling
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half RoPE in three ops. x: [B, N, heads, hd]; cos, sin: [B, N, 1, hd] with
    sin's first half negated (see Transformer.rope), so rotate_half(x) * sin == roll(x) * sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def onednn_supports(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Linear):
    """nn.Linear that, for inference on CPU, multiplies with a oneDNN-prepacked copy of its
    weight (mkldnn::_linear_pointwise). Memory-bound matvec/skinny GEMMs run at ~35-45 GB/s
    this way versus ~10-16 GB/s for F.linear's MKL path (which also gets slower for 2-32 rows).
    The packed copy is built lazily and rebuilt if the weight is replaced or modified in place."""

    _packed: tuple | None = None

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        x = x.to(w.dtype)  # float32 activations meet bf16 weights (see Transformer.act_dtype)
        if x.device.type != "cpu" or torch.is_grad_enabled() or not onednn_supports(w.dtype):
            return F.linear(x, w, self.bias)
        key = (w.data_ptr(), w._version, w.dtype, w.shape)
        if self._packed is None or self._packed[0] != key:
            with torch.inference_mode():
                self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
        return torch.ops.mkldnn._linear_pointwise(x, self._packed[1], self.bias, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w.dtype != x.dtype:  # bf16 checkpoint weights, float32 activations on CPU
            w = w.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, in_features: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv) * self.hd
        # in_features: EAGLE-3's layer attends over [embedding; hidden] (2H).
        self.wqkv = Linear(in_features or cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)  # fused q|k|v
        self.wo = Linear(self.n_heads * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: each head's query and key normalized before RoPE
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def _roped(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """q and k of [..., heads, hd] rows (padded [B, N, ...] or packed [T, ...]), after RoPE."""
        h, kvh = self.n_heads, self.n_kv
        qk = qkv[..., : h + kvh, :]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[..., :h, :]), self.k_norm(qk[..., h:, :])), dim=-2)
        return apply_rope(qk, cos, sin)

    def forward(self, x: Tensor, step: "Step", cache: KVCache) -> Tensor:
        batch = step.batch
        B, N = batch.tokens.shape
        h, kvh = self.n_heads, self.n_kv
        qkv = self.wqkv(x).to(x.dtype)  # to the cache dtype
        if step.invariant:
            return self.wo(self._invariant(qkv, step, cache))
        if step.packing is not None:
            return self.wo(self._packed(qkv, step, cache))
        qkv = qkv.view(B, N, h + 2 * kvh, self.hd)
        qk = self._roped(qkv, step.cos, step.sin)  # q and k together: [B, N, h+kvh, hd]
        q = qk[:, :, :h].transpose(1, 2)  # [B, h, N, hd]
        k = qk[:, :, h:].transpose(1, 2)  # [B, kvh, N, hd]
        v = qkv[:, :, h + kvh :].transpose(1, 2)
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [slots, kvh, cap, hd]
        C = batch.context_len
        if batch.slot_start is not None:
            s0 = batch.slot_start
            if B == 1:  # one sequence: its new block is contiguous
                p0 = step.p0
                k_cache[s0, :, p0 : p0 + N] = k[0]
                v_cache[s0, :, p0 : p0 + N] = v[0]
            else:
                k_cache[batch.slots[:, None], :, batch.write_index] = k.transpose(1, 2)
                v_cache[batch.slots[:, None], :, batch.write_index] = v.transpose(1, 2)
        else:
            k_cache[batch.slots[:, None], :, batch.write_index] = k.transpose(1, 2)
            v_cache[batch.slots[:, None], :, batch.write_index] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, *self._context(batch, cache, C), attn_mask=step.mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(B, N, self.n_heads * self.hd))

    def _invariant(self, qkv: Tensor, step: "Step", cache: KVCache) -> Tensor:
        """The invariant forward's attention (the quantized formats): RoPE and the cache write in one
        kernel pass over the new tokens, then the batch-invariant kernel reading every row's slot in
        the cache itself. Rows padded [B, N] or packed [T] (real tokens only; unpacked for attention)."""
        h, kvh, hd = self.n_heads, self.n_kv, self.hd
        batch, packing = step.batch, step.packing
        B, N = batch.tokens.shape
        rows = qkv.reshape(-1, qkv.shape[-1])
        if packing is not None:
            cos, sin, slot, column, columns = packing.cos, packing.sin, packing.token_slot, packing.token_position, packing.context
        else:
            cos, sin, slot, column, columns = step.cos, step.sin, step.row_slot, step.row_column, batch.context_len
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [slots, kvh, cap, hd]
        if self.qk_norm:  # Qwen3, Gemma 3: each head's query and key normed before RoPE, in place
            rows = kernels.head_norms(rows.contiguous(), h, kvh, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = kernels.rope_and_cache(rows, cos.reshape(-1, hd), sin.reshape(-1, hd), h, kvh, k_cache, v_cache, slot, column)
        if packing is not None:
            q = packing.unpack(q)
        q = q.view(B, N, h, hd).transpose(1, 2)  # [B, h, N, hd]
        out = invariant_attention(q, k_cache, v_cache, batch.attn_mask[:, 0], slots=batch.slots, columns=columns)
        out = out.transpose(1, 2).reshape(B, N, h * hd)  # contiguous already: a view
        return packing.pack(out) if packing is not None else out

    def _context(self, batch: ForwardBatch, cache: KVCache, columns: int) -> tuple[Tensor, Tensor]:
        """Every row's cached keys and values [B, kvh, columns, hd]: views when slots are contiguous."""
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        if batch.slot_start is not None:
            s0, B = batch.slot_start, batch.tokens.shape[0]
            return k_cache[s0 : s0 + B, :, :columns], v_cache[s0 : s0 + B, :, :columns]
        return k_cache[batch.slots, :, :columns], v_cache[batch.slots, :, :columns]

    def _packed(self, qkv: Tensor, step: "Step", cache: KVCache) -> Tensor:
        """Rows of different lengths, packed [T, D]: RoPE and the cache write on the real
        tokens only (padding never reaches the cache, so a short row beside a long one, a
        prompt chunk beside a draft tree, cannot write past its slot's capacity). A wave of
        fresh prompts attends per prompt on its own tokens (no padding, the causal half
        skipped); other rows attend over their cached prefix, padded to [B, N]."""
        h, kvh, hd = self.n_heads, self.n_kv, self.hd
        packing, batch = step.packing, step.batch
        qkv = qkv.view(-1, h + 2 * kvh, hd)
        qk = self._roped(qkv, packing.cos, packing.sin)  # [T, h+kvh, hd]
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh :]
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [slots, kvh, cap, hd]
        k_cache[packing.token_slot, :, packing.token_position] = k
        v_cache[packing.token_slot, :, packing.token_position] = v
        if packing.split is not None:
            return self._split(q, step, cache)
        if not batch.fresh_prompts:
            B, N = batch.tokens.shape
            rows = packing.unpack(q.reshape(-1, h * hd)).view(B, N, h, hd).transpose(1, 2)  # [B, h, N, hd]
            out = F.scaled_dot_product_attention(rows, *self._context(batch, cache, packing.context), attn_mask=step.mask,
                                                 enable_gqa=True)
            return packing.pack(out.transpose(1, 2).reshape(B, N, h * hd))
        out = torch.empty(q.shape[0], h * hd, dtype=q.dtype, device=q.device)
        for start, end in packing.spans:
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None],
                is_causal=True, enable_gqa=True,
            )  # [1, h, n, hd]
            out[start:end] = o[0].transpose(0, 1).reshape(end - start, h * hd)
        return out


    def _split(self, q: Tensor, step: "Step", cache: KVCache) -> Tensor:
        """Most rows decode one token, a few bring more (a draft tree, a prompt chunk): every
        row's first token attends as a decode row does ([B, h, 1, hd] over the rows' cached
        prefix, the baseline's own call), and only the few longer rows' other tokens attend
        apart, padded among themselves. Padding them all to the longest row instead made a
        one-node draft in one of 16 sequences cost every sequence a second query row."""
        h, hd = self.n_heads, self.hd
        packing, batch, split = step.packing, step.batch, step.packing.split
        B = batch.tokens.shape[0]
        roots = q.index_select(0, packing.first).view(B, 1, h, hd).transpose(1, 2)  # [B, h, 1, hd]
        root_out = F.scaled_dot_product_attention(roots, *self._context(batch, cache, split.root_context),
                                                  attn_mask=step.mask, enable_gqa=True)
        out = torch.empty(q.shape[0], h * hd, dtype=q.dtype, device=q.device)
        out.index_copy_(0, packing.first, root_out.transpose(1, 2).reshape(B, h * hd))
        R, M = split.rows.shape[0], split.width
        rest = q.index_select(0, split.gather).view(R, M, h, hd).transpose(1, 2)  # [R, h, M, hd]
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        context = (k_cache[split.slots, :, : packing.context], v_cache[split.slots, :, : packing.context])
        rest_out = F.scaled_dot_product_attention(rest, *context, attn_mask=step.rest_mask, enable_gqa=True)
        rest_out = rest_out.transpose(1, 2).reshape(R * M, h * hd).index_select(0, split.real)
        return out.index_copy_(0, split.target, rest_out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused gate|up
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # Gemma's gate; SiLU otherwise

    def forward(self, x: Tensor, fused: bool = False) -> Tensor:
        """fused: silu(gate) * up in one kernel pass (the invariant forward)."""
        gate_up = self.w13(x)
        if fused:
            return self.w2(kernels.silu_mul(gate_up, gelu=self.gelu))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)).mul_(up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # Gemma's sandwich: the attention's and the MLP's outputs are normed too, before the residual
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, step: "Step", cache: KVCache) -> Tensor:
        if self.sandwich and step.invariant:  # Gemma on the invariant forward: every norm the row kernel
            x = x.clone(memory_format=torch.contiguous_format)
            attn = self.attn(kernels.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps), step, cache)
            x.add_(kernels.rms_norm(attn.contiguous(), self.attn_out_norm.weight, self.attn_out_norm.eps))
            mlp = self.mlp(kernels.rms_norm(x, self.mlp_norm.weight, self.mlp_norm.eps), fused=True)
            return x.add_(kernels.rms_norm(mlp.contiguous(), self.mlp_out_norm.weight, self.mlp_out_norm.eps))
        if self.sandwich:
            x = x + self.attn_out_norm(self.attn(self.attn_norm(x), step, cache))
            return x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))
        if step.invariant:  # the invariant forward: each norm one row-wise kernel pass, never PyTorch's
            x = x.clone(memory_format=torch.contiguous_format)  # the caller's x (a tap, the embedding) stays as it was
            normed = kernels.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps)
            normed = kernels.rms_norm(x, self.mlp_norm.weight, self.mlp_norm.eps, residual=self.attn(normed, step, cache))
            return x.add_(self.mlp(normed, fused=True))
        x = x + self.attn(self.attn_norm(x), step, cache)
        return x + self.mlp(self.mlp_norm(x))


class Packing:
    """Where the real tokens of a padded [B, N] batch sit: pack() keeps them as [T, ...]
    (T = sum n_b) for the matmuls, unpack() puts them back in rows (padding zeros) for
    attention. Worth it when rows differ in length: a prefill wave pads every prompt to the
    longest one (3x the tokens for 16 ShareGPT prompts)."""

    def __init__(self, batch: "ForwardBatch", cos: Tensor, sin: Tensor, split: bool = True):
        num_new, (B, N) = batch.num_new, batch.tokens.shape
        device = batch.tokens.device
        real = torch.arange(N)[None, :] < torch.tensor(num_new)[:, None]  # [B, N]
        self.index = real.view(-1).nonzero().squeeze(1).to(device)  # row-major: row b's tokens in order
        self.rows = B * N
        ends = torch.tensor(num_new).cumsum(0)
        self.last = (ends - 1).to(device)  # each row's last real token in packed order
        self.spans = [(int(e) - n, int(e)) for e, n in zip(ends, num_new)]  # row b's tokens: packed[start:end]
        # per packed token: its RoPE tables [T, 1, hd] and where its key and value go in the cache
        self.cos, self.sin = self.pack(cos), self.pack(sin)
        self.token_slot = self.pack(batch.slots[:, None].expand(B, N))
        self.token_position = self.pack(batch.write_index)
        # the cache columns any real token attends to (padding columns are never written)
        self.context = int(batch.write_index.cpu().gather(1, torch.tensor(num_new)[:, None] - 1).max()) + 1
        self.first = (ends - torch.tensor(num_new)).to(device)  # each row's first token in packed order
        self.split = _SplitRows(batch, self.spans) if split and _SplitRows.worth_it(batch) else None

    @staticmethod
    def worth_it(num_new: Sequence[int]) -> bool:
        return len(num_new) > 1 and sum(num_new) < len(num_new) * max(num_new)

    def pack(self, x: Tensor) -> Tensor:
        """[B, N, ...] -> [T, ...]"""
        return x.reshape(self.rows, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """[T, D] -> [B*N, D] with zeros at the padding (callers view it as [B, N, ...])."""
        out = x.new_zeros(self.rows, x.shape[-1])
        return out.index_copy_(0, self.index, x)


class _SplitRows:
    """The layout of Attention._split: the rows with more than one new token ("long rows")
    and their tokens after the first, padded to the longest of them ([R, M])."""

    def __init__(self, batch: "ForwardBatch", spans: Sequence[tuple[int, int]]):
        device = batch.tokens.device
        long_rows = [b for b, n in enumerate(batch.num_new) if n > 1]
        self.width = M = max(batch.num_new) - 1
        gather, real, target = [], [], []
        for r, b in enumerate(long_rows):
            start, end = spans[b]
            tokens = list(range(start + 1, end))
            gather += tokens + [start] * (M - len(tokens))  # padding reads any real token; its output is dropped
            real += range(r * M, r * M + len(tokens))
            target += tokens
        self.rows = torch.tensor(long_rows, dtype=torch.long, device=device)
        self.slots = batch.slots.index_select(0, self.rows)
        self.gather, self.real, self.target = (torch.tensor(x, dtype=torch.long, device=device) for x in (gather, real, target))
        self.root_context = int(batch.write_index[:, 0].max()) + 1  # what the first tokens attend to

    @staticmethod
    def worth_it(batch: "ForwardBatch") -> bool:
        """Rows already in the cache, at most half of them long (else padding them all is as cheap)."""
        long_rows = sum(n > 1 for n in batch.num_new)
        return not batch.fresh_prompts and 0 < long_rows <= len(batch.num_new) // 2


def last_tokens(x: Tensor, batch: ForwardBatch, packing: Packing | None) -> Tensor:
    """Each row's last real token of x ([B, N, ...] rows, or [T, ...] packed) -> [B, ...]."""
    if packing is not None:
        return x.index_select(0, packing.last)
    last = torch.tensor([n - 1 for n in batch.num_new], device=x.device)
    return x[torch.arange(x.shape[0], device=x.device), last]


@dataclass
class Step:
    """Per-forward inputs shared by all layers, computed once."""
    batch: ForwardBatch
    cos: Tensor  # [B, N, 1, hd]
    sin: Tensor  # [B, N, 1, hd], first half negated (rotate-half folded in)
    mask: Tensor  # [B, 1, N, C] additive (0 / -inf) in the activation dtype
    p0: int  # first write column when B == 1
    packing: Packing | None = None  # the residual stream is [T, H] (real tokens only) when set
    rest_mask: Tensor | None = None  # [R, 1, M, C] of the long rows' later tokens (packing.split); mask is then the first tokens'
    invariant: bool = False  # attention by kernels.invariant_attention on batch.attn_mask (mask unused)
    row_slot: Tensor | None = None  # invariant, unpacked: [B * N] int64 cache slot of every row's token
    row_column: Tensor | None = None  # invariant, unpacked: [B * N] int64 cache column it writes


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [B, N, 1, hd]; sin's first half is negated for apply_rope."""
    freqs = positions[:, :, None, None].float() * inv_freq  # [B, N, 1, hd/2]
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def prepare_step(batch: ForwardBatch, inv_freq: Tensor, dtype: torch.dtype, pack: bool = False,
                 invariant: bool = False, rope: RopeTable | None = None) -> Step:
    """pack: run the residual stream on the real tokens only (see Packing) when rows differ in length.
    invariant: every attention through the batch-invariant kernel (Transformer.batch_invariant).
    rope: the model's table of every position's cos and sin (the invariant forward reads it, as
    the native forward does: a position's values never depend on the batch)."""
    cos, sin = rope.lookup(batch.positions) if rope is not None else rope_tables(batch.positions, inv_freq, dtype)
    p0 = int(batch.write_index[0, 0]) if batch.tokens.shape[0] == 1 else 0
    packing = Packing(batch, cos, sin, split=not invariant) if pack and Packing.worth_it(batch.num_new) else None
    if invariant:
        B, N = batch.tokens.shape
        row_slot = batch.slots[:, None].expand(B, N).reshape(-1).contiguous()
        return Step(batch, cos, sin, torch.empty(0), p0, packing, invariant=True, row_slot=row_slot,
                    row_column=batch.write_index.reshape(-1).contiguous())
    if packing is not None and batch.fresh_prompts:
        mask = torch.empty(0)  # attention runs per prompt, causally (Attention._packed)
    elif packing is not None and packing.split is not None:
        split = packing.split
        mask = _additive(batch.attn_mask[:, :, :1, : split.root_context], dtype)
        rest = batch.attn_mask.index_select(0, split.rows)[:, :, 1 : split.width + 1, : packing.context].clone()
        padding = torch.arange(split.width, device=rest.device)[None, :] >= (
            torch.tensor(batch.num_new, device=rest.device).index_select(0, split.rows) - 1)[:, None]  # [R, M]
        rest[:, 0, :, 0] |= padding  # a padding row keeps column 0 (no empty softmax row)
        return Step(batch, cos, sin, mask, p0, packing, _additive(rest, dtype))
    else:
        allowed = batch.attn_mask
        if packing is not None:  # only the columns real tokens wrote; a padding row keeps column 0 (no empty softmax row)
            allowed = allowed[..., : packing.context].clone()
            padding = torch.arange(allowed.shape[2], device=allowed.device)[None, :] >= torch.tensor(
                batch.num_new, device=allowed.device)[:, None]  # [B, N]
            allowed[:, 0, :, 0] |= padding
        mask = _additive(allowed, dtype)
    return Step(batch, cos, sin, mask, p0, packing)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """An additive mask (0 / -inf) once per forward: a bool mask is converted inside SDPA in every layer."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


@dataclass
class ForwardOutput:
    logits: Tensor  # [B, N, V] (or [B, 1, V] with last_only) float32
    hidden_taps: Tensor | None  # [B, N, len(tap_layers) * H] outputs of the requested layers, in order


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Gemma 3's local (sliding-window) layers: their own window and RoPE base
        self.local_layers = frozenset(i for i, kind in enumerate(cfg.layer_types or ()) if kind == SLIDING_ATTENTION)
        self.reset_rope_tables()
        # Attention by kernels.invariant_attention: set with row-invariant weight kernels (the
        # quantized formats, quantized.py), whose forward is then batch-invariant as a whole.
        self.batch_invariant = False
        # The invariant forward in one native call (native_forward.py) where the plan runs this
        # model's layers; False keeps the per-op path (the oracle the native forward must equal).
        self.native_forward = True
        self._native_plan: native_forward.ForwardPlan | None = None
        self._native_checked = False

    def reset_rope_tables(self, device: torch.device | str | None = None) -> None:
        """The RoPE frequencies (not in the checkpoint): again after a model built on the meta device."""
        device = device or self.embed.weight.device
        self.register_buffer("inv_freq", rope_inv_freq(self.cfg).to(device), persistent=False)
        self.rope_table = RopeTable(self.inv_freq)
        self.local_rope_table = None
        if self.local_layers:
            local = dataclasses.replace(self.cfg, rope_theta=self.cfg.local_rope_theta, rope_scaling=None)
            self.register_buffer("local_inv_freq", rope_inv_freq(local).to(device), persistent=False)
            self.local_rope_table = RopeTable(self.local_inv_freq)

    def native_plan(self) -> "native_forward.ForwardPlan | None":
        """The native forward's plan for this model, built at its first forward (None: the per-op path
        serves: not a quantized format, a family it does not run, or SPECDEC_NATIVE_FORWARD=0)."""
        if not (self.native_forward and self.batch_invariant and native_forward.enabled()):
            return None
        if not self._native_checked:
            self._native_plan = native_forward.ForwardPlan.of(self, self.rope_table, self.local_rope_table)
            self._native_checked = True
        return self._native_plan

    def forget_native_plan(self) -> None:
        """After the weights were replaced: the next forward builds the plan again."""
        self._native_plan, self._native_checked = None, False

    @property
    def act_dtype(self) -> torch.dtype:
        """Activations and the KV cache. On CPU always float32: bf16/fp16 weights are then
        weight-only low precision (halving the bytes streamed per token), while the norms, RoPE,
        attention and residual stream use the fast, exact float32 kernels (PyTorch's bf16 SDPA
        and rms_norm are 3-5x slower than float32 at decode shapes on CPU)."""
        p = self.embed.weight
        return torch.float32 if p.device.type == "cpu" else p.dtype

    def new_cache(self, max_slots: int, max_seq_len: int, max_new_per_step: int,
                  prefix_block_tokens: int | None = None) -> KVCache:
        p = self.embed.weight
        return KVCache(
            self.cfg.num_layers, max_slots, self.cfg.num_kv_heads, max_seq_len, self.cfg.head_dim,
            max_new_per_step, dtype=self.act_dtype, device=p.device, prefix_block_tokens=prefix_block_tokens,
        )


    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        tap_layers: Sequence[int] = (),
        last_only: bool = False,
        pack: bool = True,
        logits_rows: Sequence[int] | None = None,
    ) -> ForwardOutput:
        """logits_rows[b]: how many of row b's last real tokens need logits (a prompt chunk
        that does not end its prompt needs none); last_only is 1 for every row, and None is
        every token. The logits are then [B, max(logits_rows), V], row b's in [:logits_rows[b]].
        pack=False keeps every row padded (the path before Packing: benchmarks and tests compare)."""
        plan = self.native_plan()
        if plan is not None:
            rows = [1] * len(batch.num_new) if last_only else list(batch.num_new) if logits_rows is None else list(logits_rows)
            logits, hidden = plan.forward(batch, cache, tap_layers, rows)
            return ForwardOutput(logits=logits, hidden_taps=hidden)
        invariant = self.batch_invariant
        step = prepare_step(batch, self.inv_freq, self.act_dtype, pack=pack, invariant=invariant,
                            rope=self.rope_table if invariant else None)
        local = None
        if self.local_layers:  # the same tokens packed the same way, a windowed mask, the local RoPE
            local = prepare_step(windowed(batch, self.cfg.local_window), self.local_inv_freq, self.act_dtype, pack=pack,
                                 invariant=invariant, rope=self.local_rope_table if invariant else None)
        packing = step.packing
        tokens = batch.tokens if packing is None else packing.pack(batch.tokens)
        x = self.embed(tokens).to(self.act_dtype)  # [B, N, H], or [T, H] packed
        if self.cfg.embed_scale is not None:  # Gemma: sqrt(hidden_size), rounded to the activations' dtype
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, local if i in self.local_layers else step, cache)
            if i in tap_layers:
                taps[i] = x
        B, N = batch.tokens.shape
        if last_only:  # prefill: only the last real token's logits are needed
            x = last_tokens(x, batch, packing)[:, None]
        elif logits_rows is not None:
            return ForwardOutput(self._row_logits(x, batch, packing, logits_rows), self._taps(taps, tap_layers, packing, B, N))
        logits = self.lm_head(self.final_norm(x)).float()
        if packing is not None and not last_only:
            logits = packing.unpack(logits).view(B, N, -1)
        return ForwardOutput(logits=logits, hidden_taps=self._taps(taps, tap_layers, packing, B, N))

    def final_norm(self, x: Tensor) -> Tensor:
        """The last norm: on the invariant forward the row-wise kernel (PyTorch's rms_norm is invariant
        only by observation), as the native forward runs it."""
        if self.batch_invariant and x.device.type == "cpu" and x.dtype == self.norm.weight.dtype == torch.float32:
            return kernels.rms_norm(x.contiguous(), self.norm.weight, self.norm.eps)
        return self.norm(x)

    @staticmethod
    def _taps(taps: dict[int, Tensor], tap_layers: Sequence[int], packing: Packing | None, B: int, N: int) -> Tensor | None:
        hidden = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None  # in the order asked
        if hidden is not None and packing is not None:
            hidden = packing.unpack(hidden).view(B, N, -1)
        return hidden

    def _row_logits(self, x: Tensor, batch: ForwardBatch, packing: Packing | None, logits_rows: Sequence[int]) -> Tensor:
        """The lm_head (a 49k-row GEMM, the largest of the model) on the tokens whose logits are used only."""
        B, N = batch.tokens.shape
        flat = x if packing is not None else x.reshape(B * N, -1)
        index, out_index, width = [], [], max(logits_rows, default=0)
        for b, (k, n) in enumerate(zip(logits_rows, batch.num_new)):
            end = packing.spans[b][1] if packing is not None else b * N + n
            index.extend(range(end - k, end))
            out_index.extend(range(b * width, b * width + k))
        picked = flat.index_select(0, torch.tensor(index, dtype=torch.long, device=x.device))
        logits = self.lm_head(self.final_norm(picked)).float()
        if len(out_index) == B * width:  # every row needs `width` logits: already in place
            return logits.view(B, width, logits.shape[-1])
        # Zeros only where no logits go (a [B * width, 49k] memset cost ~1 ms a step).
        out = logits.new_empty(B * width, logits.shape[-1])
        out.index_copy_(0, torch.tensor(out_index, dtype=torch.long, device=x.device), logits)
        unused = sorted(set(range(B * width)) - set(out_index))
        return out.index_fill_(0, torch.tensor(unused, dtype=torch.long, device=x.device), 0.0).view(B, width, logits.shape[-1])

    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Map HF Llama/Mistral/Qwen2/Qwen3 weight names onto this module's fused layout."""
        cfg = self.cfg

        def take(name: str) -> Tensor:
            if name not in sd:
                raise KeyError(f"weight {name!r} missing from checkpoint")
            return sd[name]

        own: dict[str, Tensor] = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
        own["lm_head.weight"] = own["embed.weight"] if cfg.tie_word_embeddings and "lm_head.weight" not in sd else take("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = f"{p}self_attn."
            own[f"layers.{i}.attn.wqkv.weight"] = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])
            if cfg.qkv_bias:
                own[f"layers.{i}.attn.wqkv.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
            own[f"layers.{i}.attn.wo.weight"] = take(a + "o_proj.weight")
            if cfg.qk_norm:
                own[f"layers.{i}.attn.q_norm.weight"] = take(a + "q_norm.weight")
                own[f"layers.{i}.attn.k_norm.weight"] = take(a + "k_norm.weight")
            if cfg.o_bias:
                own[f"layers.{i}.attn.wo.bias"] = take(a + "o_proj.bias")
            own[f"layers.{i}.mlp.w13.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            own[f"layers.{i}.mlp.w2.weight"] = take(p + "mlp.down_proj.weight")
            own[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
            if cfg.sandwich_norms:  # Gemma: input, post-attention, pre- and post-feedforward norms
                own[f"layers.{i}.attn_out_norm.weight"] = take(p + "post_attention_layernorm.weight")
                own[f"layers.{i}.mlp_norm.weight"] = take(p + "pre_feedforward_layernorm.weight")
                own[f"layers.{i}.mlp_out_norm.weight"] = take(p + "post_feedforward_layernorm.weight")
            else:
                own[f"layers.{i}.mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        if cfg.model_type == GEMMA3:
            _gemma_norms(own, cfg)
        dtype = self.embed.weight.dtype
        self.load_state_dict({k: v.to(dtype) for k, v in own.items()}, strict=True)


def _gemma_norms(own: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Gemma stores each RMSNorm's weight as w and scales by (1 + w), in float32: ours scale by
    the weight, so it becomes 1 + w. Its queries are scaled by query_pre_attn_scalar ** -0.5
    where attention scales by head_dim ** -0.5: the ratio is folded into the query norm (a
    per-channel scale before RoPE, which RoPE commutes with)."""
    for name in [n for n in own if n.endswith("norm.weight")]:
        own[name] = 1.0 + own[name].float()
    ratio = (cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5
    for i in range(cfg.num_layers):
        own[f"layers.{i}.attn.q_norm.weight"] = own[f"layers.{i}.attn.q_norm.weight"] * ratio
