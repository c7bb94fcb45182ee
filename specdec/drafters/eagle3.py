"""EAGLE-3 drafting: linear chains and EAGLE-2 dynamic trees from the head's own KV cache.

Per sequence the head keeps a KV-cache slot whose committed length equals the number of
(target hidden, next token) pairs it has seen. What the verifier keeps arrives as pending
pairs; `propose` runs every sequence's pending pairs in one ragged head pass, then drafts
(one batched head pass per draft depth, over all sequences).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from ..config import SpeculativeConfig
from ..models.eagle3 import Eagle3Head, draft_log_probs, mapped_logits
from ..models.llama import ForwardBatch, build_batch
from ..sampling import logits_to_probs
from ..sequence import SequenceState
from ..tree import DETERMINISTIC, ROOT, DraftTree
from .base import Drafter


@dataclass
class _HeadState:
    slot: int
    pending_hidden: list[Tensor] = field(default_factory=list)  # [n_i, 3H] target taps
    pending_tokens: list[int] = field(default_factory=list)  # the token after each tap's position
    last_hidden: Tensor | None = None  # [H] head output at the last committed pair
    last_logits: Tensor | None = None  # [Vd]


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, head: Eagle3Head, config: SpeculativeConfig, max_batch_size: int, max_seq_len: int):
        self.head = head
        self.config = config
        self.tap_layers = tuple(head.cfg.tap_layers)
        width = config.dynamic_tree_max_topK if config.use_dynamic_tree else 1
        # Slack past a full prefix for the uncommitted draft nodes of one step.
        self.cache = head.new_cache(max_batch_size, max_seq_len, 64 + width * config.max_draft_len)
        self.draft_to_target = head.draft_to_target

    # ---- sequence life cycle --------------------------------------------------------------
    def on_prefill(self, seq: SequenceState, hidden: Tensor | None) -> None:
        if hidden is None:
            raise ValueError("EAGLE-3 needs the target's hidden taps of the prompt")
        state = _HeadState(self.cache.allocate())
        seq.drafter_state[self.name] = state
        # Pair the tap of position i with token i+1 (the first generated token closes the prompt).
        state.pending_hidden.append(hidden.float())
        state.pending_tokens += seq.prompt_ids[1:] + [seq.output_ids[0]]

    def on_verified(self, seq: SequenceState, emitted: list[int], accepted: int, hidden: Tensor | None) -> None:
        state: _HeadState = seq.drafter_state[self.name]
        state.pending_hidden.append(hidden.float())  # [1 + accepted, 3H]: root + accepted tokens
        state.pending_tokens += emitted  # accepted tokens + bonus/recovered token

    def on_finish(self, seq: SequenceState) -> None:
        state = seq.drafter_state.pop(self.name, None)
        if state is not None:
            self.cache.release(state.slot)

    # ---- drafting ---------------------------------------------------------------------------
    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int]) -> list[DraftTree]:
        states = [s.drafter_state[self.name] for s in seqs]
        self._absorb_pending(states)
        trees = [DraftTree() for _ in seqs]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if not active:
            return trees
        if self.config.use_dynamic_tree:
            for i, tree in zip(active, self._dynamic_trees([seqs[i] for i in active], [states[i] for i in active], [budgets[i] for i in active])):
                trees[i] = tree
        else:
            for i, tree in zip(active, self._chains([seqs[i] for i in active], [states[i] for i in active], [budgets[i] for i in active])):
                trees[i] = tree
        return trees

    def _absorb_pending(self, states: list[_HeadState]) -> None:
        """Run every sequence's pending pairs through the head in one ragged pass, commit them."""
        todo = [s for s in states if s.pending_tokens]
        if not todo:
            return
        hidden = [torch.cat(s.pending_hidden) for s in todo]
        batch = build_batch([s.slot for s in todo], [self.cache.lengths[s.slot] for s in todo], [s.pending_tokens for s in todo])
        N = max(len(s.pending_tokens) for s in todo)
        padded = torch.zeros(len(todo), N, hidden[0].shape[-1])
        for b, h in enumerate(hidden):
            padded[b, : h.shape[0]] = h
        out_hidden, logits = self.head(padded, batch, self.cache)
        for b, s in enumerate(todo):
            n = len(s.pending_tokens)
            self.cache.commit(s.slot, range(n))
            s.last_hidden, s.last_logits = out_hidden[b, n - 1], logits[b, n - 1]
            s.pending_hidden, s.pending_tokens = [], []

    def _step(self, states: list[_HeadState], hidden: Tensor, tokens: list[list[int]], offsets: list[int],
              depths: list[list[int]], masks: list[Tensor]) -> tuple[Tensor, Tensor]:
        """One head pass over uncommitted draft nodes. Node j of row b is written at cache
        column committed + offsets[b] + j, at RoPE position committed + depth, and attends
        to the committed prefix plus the columns masks[b][j] marks among the drafted ones."""
        B, N = len(states), max(len(t) for t in tokens)
        prefix = torch.tensor([self.cache.lengths[s.slot] for s in states])
        C = int(prefix.max()) + max(o for o in offsets) + N
        tok = torch.zeros(B, N, dtype=torch.long)
        pos = torch.zeros(B, N, dtype=torch.long)
        write = torch.zeros(B, N, dtype=torch.long)
        allow = torch.zeros(B, N, C, dtype=torch.bool)
        for b in range(B):
            n, p, o = len(tokens[b]), int(prefix[b]), offsets[b]
            tok[b, :n] = torch.tensor(tokens[b])
            pos[b, :n] = p + torch.tensor(depths[b])
            write[b] = p + o + torch.arange(N)
            allow[b, :, :p] = True
            allow[b, :n, p : p + o + n] = masks[b]
            allow[b, n:, p + o + n : p + o + N] = torch.eye(N - n, dtype=torch.bool)  # padding: itself
        slots = [s.slot for s in states]
        contiguous = all(x == slots[0] + i for i, x in enumerate(slots))
        batch = ForwardBatch(tok, pos, torch.tensor(slots), write, allow[:, None], [len(t) for t in tokens],
                             slots[0] if contiguous else None)
        return self.head(hidden, batch, self.cache)

    def _chains(self, seqs, states, budgets) -> list[DraftTree]:
        """Linear drafts: argmax (greedy) or sampled with draft probabilities."""
        B = len(seqs)
        tokens: list[list[int]] = [[] for _ in range(B)]
        probs: list[list[Tensor]] = [[] for _ in range(B)]
        logits = torch.stack([s.last_logits for s in states])
        hidden = torch.stack([s.last_hidden for s in states])[:, None]
        for depth in range(max(budgets)):
            for b, seq in enumerate(seqs):
                if depth < budgets[b]:
                    token, q = self._pick(seq, logits[b])
                    tokens[b].append(token)
                    if q is not None:
                        probs[b].append(q)
            if depth + 1 == max(budgets):
                break
            masks = [torch.ones(1, depth + 1, dtype=torch.bool) for _ in range(B)]
            last = [[t[-1]] for t in tokens]
            out_hidden, out_logits = self._step(states, hidden, last, [depth] * B, [[depth]] * B, masks)
            hidden, logits = out_hidden, out_logits[:, 0]
        return [
            DraftTree.chain(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)
        ]

    def _pick(self, seq: SequenceState, draft_logits: Tensor) -> tuple[int, Tensor | None]:
        if seq.params.greedy:
            return int(self.draft_to_target[int(draft_logits.argmax())]), None
        q = logits_to_probs(mapped_logits(self.head, draft_logits), seq.params)  # same processing as the target
        return int(torch.multinomial(q, 1, generator=seq.generator)), q

    def _dynamic_trees(self, seqs, states, budgets) -> list[DraftTree]:
        """EAGLE-2: expand the top-k frontier per depth by cumulative log-prob, then keep the
        best `budget` nodes of all depths. Children are chosen deterministically (top-k), so
        verification uses the one-hot rule, lossless under sampling too."""
        cfg = self.config
        k = cfg.dynamic_tree_max_topK
        trees = []
        B = len(seqs)
        # Per row: candidate nodes (token, parent candidate index, score, depth).
        cands: list[list[tuple[int, int, float, int]]] = [[] for _ in range(B)]
        logp = draft_log_probs(torch.stack([s.last_logits for s in states]))  # [B, Vd]
        top = logp.topk(k, dim=-1)
        frontier: list[list[int]] = []  # candidate indices expanded next, per row
        for b in range(B):
            for score, d in zip(top.values[b].tolist(), top.indices[b].tolist()):
                cands[b].append((int(self.draft_to_target[d]), ROOT, score, 1))
            frontier.append(list(range(len(cands[b]))))
        written: list[list[int]] = [[] for _ in range(B)]  # candidate index of each written cache column
        hidden_of: list[dict[int, Tensor]] = [{} for _ in range(B)]
        parent_hidden = torch.stack([s.last_hidden for s in states])  # [B, H]
        for depth in range(1, min(cfg.max_draft_len, max(budgets))):  # a node at depth d needs a budget >= d
            tokens, depths, masks, offsets, hid = [], [], [], [], []
            for b in range(B):
                offsets.append(len(written[b]))
                rows = frontier[b]
                tokens.append([cands[b][c][0] for c in rows])
                depths.append([depth - 1] * len(rows))
                cols = written[b] + rows
                mask = torch.zeros(len(rows), len(cols), dtype=torch.bool)
                for j, c in enumerate(rows):
                    anc = self._ancestors(cands[b], c)
                    for col, cand in enumerate(cols):
                        mask[j, col] = cand in anc
                masks.append(mask)
                hid.append(torch.stack([hidden_of[b].get(cands[b][c][1], parent_hidden[b]) for c in rows]))
            N = max(len(t) for t in tokens)
            hidden = torch.zeros(B, N, parent_hidden.shape[-1])
            for b in range(B):
                hidden[b, : len(hid[b])] = hid[b]
            out_hidden, out_logits = self._step(states, hidden, tokens, offsets, depths, masks)
            child_logp = draft_log_probs(out_logits)
            for b in range(B):
                rows = frontier[b]
                written[b] += rows
                new = []
                for j, c in enumerate(rows):
                    hidden_of[b][c] = out_hidden[b, j]
                    vals, idx = child_logp[b, j].topk(k)
                    for v, d in zip(vals.tolist(), idx.tolist()):
                        new.append((int(self.draft_to_target[d]), c, cands[b][c][2] + v, depth + 1))
                start = len(cands[b])
                cands[b] += new
                order = sorted(range(len(new)), key=lambda i: -new[i][2])[:k]
                frontier[b] = [start + i for i in order]
        for b in range(B):
            trees.append(self._rerank(cands[b], budgets[b]))
        return trees

    @staticmethod
    def _ancestors(cands, c: int) -> set[int]:
        out = set()
        while c != ROOT:
            out.add(c)
            c = cands[c][1]
        return out

    @staticmethod
    def _rerank(cands, budget: int) -> DraftTree:
        """The `budget` best candidates (a parent always outscores its children, and ties
        go to the shallower node, so the kept set is a tree), in topological order."""
        best = sorted(range(len(cands)), key=lambda i: (-cands[i][2], cands[i][3], i))[:budget]
        keep = sorted(best, key=lambda i: (cands[i][3], i))
        index = {c: n for n, c in enumerate(keep)}
        tokens = [cands[c][0] for c in keep]
        parents = [ROOT if cands[c][1] == ROOT else index[cands[c][1]] for c in keep]
        return DraftTree(tokens, parents, None, DETERMINISTIC)
