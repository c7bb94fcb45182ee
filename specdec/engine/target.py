"""The target pass: KV-cache slots per sequence, batched prefill, batched tree verification
(the acceptance rules themselves are specdec.engine.acceptance's).

Keyed by sequence id so it runs inside the Triton `verifier` model or in process beside
the drafters (SpecEngine). It remembers each sequence's root token (the
last emitted token, not yet in the cache), its sampling settings and its generator.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch
from torch import Tensor

from specdec.config import EngineConfig, SamplingParams
from specdec.errors import CapacityError, InvalidRequestError
from specdec.engine.logits_processing import TokenLogProbs, apply_rules, token_log_probs
from specdec.engine.models.llama import Transformer, build_batch
from specdec.engine.sampling import logits_to_probs, make_generator, sample
from specdec.engine.sequences import KeyedSequences, SequenceRecord
from specdec.engine.tree import DraftTree
from specdec.engine.acceptance import VerifyResult, verify_greedy, verify_sampled
from specdec.engine.grammar import Grammars, GuidedSequence, masked_draft_probs, open_dead_ends
from specdec.engine.prefix_cache import PrefixCacheCounters


@dataclass
class _TargetSequence:
    record: SequenceRecord  # the sequence's one record: its settings, and its tokens (appended here)
    slot: int
    generator: torch.Generator
    last_used: float = 0.0
    # while the prompt is prefilled in chunks: its tokens not in the cache yet, and the
    # hidden taps of those that are (handed to the drafter with the first token)
    unprefilled: list[int] = field(default_factory=list)
    prompt_hidden: list[Tensor] = field(default_factory=list)
    guide: GuidedSequence | None = None  # the request's grammar, at the committed context
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def params(self) -> SamplingParams:
        return self.record.params

    @property
    def root_token(self) -> int:
        return self.record.root_token

    def processed(self, logits: Tensor, tree: DraftTree | None = None, bitmask: Tensor | None = None) -> Tensor:
        """The target's logits as plain decoding would use them at each tree row: the
        request's logits rules, then its grammar's mask (bitmask: this tree's, from
        GuidedSequence.masks; computed here when not given)."""
        # the rules that read the context (specdec/engine/logits_processing.py): prompt +
        # every emitted token, the root last
        shaped = self.params.shapes_logits
        record = self.record
        ruled = apply_rules(logits, self.params, len(record.prompt_ids), record.all_ids, tree) if shaped else logits
        if self.guide is None:
            return ruled
        if bitmask is None:
            bitmask = self.guide.masks(tree)
        return self.guide.apply(ruled, bitmask, unruled=logits if shaped else None)

    def emitted(self, tokens: list[int]) -> None:
        """Tokens committed: the one place a sequence's emitted tokens are counted."""
        self.record.output_ids.extend(tokens)
        if self.guide is not None:
            self.guide.advance(tokens)


@dataclass
class PrefillOutput:
    first_token: int
    hidden: Tensor | None  # [prompt_len, taps * H] when taps were asked for
    log_probs: TokenLogProbs | None = None  # of first_token, with return_log_probs / top_logprobs
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class VerifyOutput:
    result: VerifyResult
    hidden: Tensor | None  # [1 + accepted, taps * H]: root + accepted path, when asked for
    log_probs: TokenLogProbs | None = None  # of emitted, with return_log_probs / top_logprobs
    # The accepted path ends where the request's grammar allows no token (grammar.UNPRODUCIBLE):
    # the bonus token is not emitted, and the sequence must end with that error.
    dead_end: bool = False

    @property
    def emitted(self) -> list[int]:
        return self.result.accepted_tokens if self.dead_end else self.result.emitted


class TargetPass(KeyedSequences[_TargetSequence]):
    where = "verifier"  # the Triton model it serves in (named in errors)

    def __init__(self, target: Transformer, config: EngineConfig, tap_layers: Sequence[int] = (),
                 grammars: Grammars | None = None):
        """grammars: compiles the requests' guides (None: guided requests are refused)."""
        super().__init__()
        self.grammars = grammars
        self.target = target
        self.config = config
        self.tap_layers = tuple(tap_layers)
        self.device = target.embed.weight.device
        self.cache = target.new_cache(config.max_batch_size, config.max_seq_len, config.max_num_draft_tokens + 1,
                                      config.prefix_cache_block)
        # With prefix caching, each slot's hidden taps beside its KV: a drafter that reads them
        # (EAGLE-3, Medusa) gets the cached prefix's taps exactly as a full prefill makes them.
        # taps_len[slot]: how many leading positions hold taps (a forward without taps stops it).
        self.taps: Tensor | None = None
        self.taps_len = [0] * config.max_batch_size
        if self.cache.prefix is not None and self.tap_layers:
            width = len(self.tap_layers) * target.cfg.hidden_size
            self.taps = torch.zeros((config.max_batch_size, self.cache.capacity, width), dtype=target.act_dtype, device=self.device)

    def context_len(self, seq_id: Hashable) -> int:
        return self.cache.lengths[self._get(seq_id).slot]

    def prefilling(self, seq_id: Hashable) -> bool:
        """Admitted, its prompt not all in the cache yet (no first token)."""
        return bool(self._get(seq_id).unprefilled)

    def admit(self, records: Sequence[SequenceRecord], needs_taps: frozenset = frozenset()) -> None:
        """Give each sequence (its record: held, not copied) a slot; its prompt is prefilled by run() (in chunks, possibly
        over several calls), after the longest prefix the cache holds (needs_taps: ids whose
        prefill must return the taps of the whole prompt: a reused prefix is then one whose
        taps are held too). Prompts were checked at the trust boundary (validate_request:
        in process, or in the Triton loop in front of the verifier). Raises before changing
        anything if a sequence id is taken or slots run out."""
        for record in records:
            if record.seq_id in self._seqs:
                raise InvalidRequestError("sequence_id", f"sequence {record.seq_id!r} is already running")
        if len(records) > self.cache.num_free:
            raise CapacityError(f"no free KV-cache slot: {self.cache.max_slots} slots (max_batch_size) in use")
        guides = [self._start_guide(record.params) for record in records]
        now = time.monotonic()
        for record, guide in zip(records, guides):
            seq_id, prompt, params = record.seq_id, record.prompt_ids, record.params
            slot, reused = self._claim_slot(prompt, params.cache_salt, seq_id in needs_taps)
            seq = self._seqs[seq_id] = _TargetSequence(
                record, slot, make_generator(params.seed), last_used=now, unprefilled=list(prompt[reused:]), guide=guide,
                cached_tokens=reused,
            )
            if reused and seq_id in needs_taps:
                seq.prompt_hidden.append(self.taps[slot, :reused].clone())

    def _claim_slot(self, prompt: Sequence[int], salt: str | None, needs_taps: bool) -> tuple[int, int]:
        """A slot holding the prompt's longest cached prefix: (slot, tokens reused). At least
        the prompt's last token is computed (its logits sample the first token)."""
        cache = self.cache
        found = cache.lookup(prompt, salt, len(prompt) - 1)
        if found is not None and needs_taps:
            found.tokens = min(found.tokens, self.taps_len[found.slot])
        slot = cache.claim(prompt, salt, found)
        reused = cache.lengths[slot]
        if self.taps is not None:
            if found is not None and reused and found.slot != slot:
                self.taps[slot, :reused] = self.taps[found.slot, :reused]
            self.taps_len[slot] = min(self.taps_len[found.slot], reused) if found is not None and reused else 0
        if cache.prefix is not None:
            cache.prefix.record(len(prompt), reused)
        return slot, reused

    def _keep_taps(self, slot: int, start: int, taps: Tensor | None) -> None:
        """Hold the taps of positions committed at `start` (while they continue the held ones)."""
        if self.taps is None or taps is None or self.taps_len[slot] != start:
            return
        self.taps[slot, start : start + taps.shape[0]] = taps
        self.taps_len[slot] = start + taps.shape[0]

    @property
    def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        return None if self.cache.prefix is None else self.cache.prefix.counters

    def reset_prefix_counters(self) -> None:
        if self.cache.prefix is not None:
            self.cache.prefix.counters = PrefixCacheCounters()

    def _start_guide(self, params: SamplingParams) -> GuidedSequence | None:
        if not params.guided:
            return None
        if self.grammars is None:
            raise InvalidRequestError("guided_decoding_guide_type", "this engine was built without a tokenizer for grammars")
        return self.grammars.start(params.guide_type, params.guide, params.end_ids)

    def guided_draft(self, seq_id: Hashable, tree: DraftTree, budget: int, forced: bool) -> DraftTree:
        """The tree to verify for a sequence under a grammar: its forced tokens first (when
        `forced`), the drafts it forbids pruned, at most `budget` nodes. Others: the tree."""
        guide = self._get(seq_id).guide
        return tree if guide is None else guide.draft(tree, budget, forced)

    def prefill(self, records: Sequence[SequenceRecord], want_hidden: bool = False) -> list[PrefillOutput]:
        """Start sequences and prefill their whole prompts in one forward (admit + run)."""
        ids = [record.seq_id for record in records]
        self.admit(records, frozenset(ids) if want_hidden else frozenset())
        done, _ = self.run(ids, [], want_hidden)
        return [done[seq_id] for seq_id in ids]

    def unprefilled(self, seq_id: Hashable) -> int:
        """Prompt tokens of the sequence not yet run (after its cached prefix)."""
        return len(self._get(seq_id).unprefilled)

    def verify(self, items: Sequence[tuple[Hashable, DraftTree]], want_hidden: bool = False) -> list[VerifyOutput]:
        return self.run([], items, want_hidden)[1]

    def run(
        self,
        prefilling: Sequence[Hashable],
        items: Sequence[tuple[Hashable, DraftTree]],
        want_hidden: bool = False,
        prefill_tokens: int | None = None,
    ) -> tuple[dict[Hashable, PrefillOutput], list[VerifyOutput]]:
        """ONE batched target forward over the next chunk of each prefilling sequence's prompt
        (in order, at most prefill_tokens in all; None: whole prompts) and [root] + tree for
        every item: a running sequence keeps decoding while prompts are prefilled, and the
        weights are streamed once for both. Accepts each tree (greedy or lossless sampling)
        and commits the kept path's KV; a prompt's last chunk samples its first token.
        Returns the prefills that finished (by id) and one VerifyOutput per item."""
        chunks, budget = [], prefill_tokens
        for seq_id in prefilling:
            seq = self._get(seq_id)
            n = len(seq.unprefilled) if budget is None else min(len(seq.unprefilled), budget)
            if n <= 0:
                break
            chunks.append((seq_id, seq, seq.unprefilled[:n]))
            budget = None if budget is None else budget - n
        seqs = [self._get(seq_id) for seq_id, _ in items]
        trees = [tree for _, tree in items]
        # each guided tree's grammar masks, and its draft distributions masked the same way
        bitmasks = [None if seq.guide is None else seq.guide.masks(tree) for seq, tree in zip(seqs, trees)]
        # rows where the grammar allows nothing: a leaf (its children were pruned) or the root;
        # all allowed for the forward's arithmetic, and nothing is emitted from them below
        dead_rows = [None if bits is None else open_dead_ends(bits) for bits in bitmasks]
        trees = [tree if bits is None else masked_draft_probs(tree, bits) for tree, bits in zip(trees, bitmasks)]
        # rows (sequence, tokens, depths, mask): the chunks (causal chains), then [root] + tree
        rows = [(seq, chunk, None, None) for _, seq, chunk in chunks]
        rows += [(seq, *tree.input_rows(seq.root_token)) for seq, tree in zip(seqs, trees)]
        if not rows:
            return {}, []
        order = sorted(range(len(rows)), key=lambda r: rows[r][0].slot)  # contiguous slots make the cache a view
        row_of = {r: b for b, r in enumerate(order)}
        chains_only = not items
        batch = build_batch(
            [rows[r][0].slot for r in order], [self.cache.lengths[rows[r][0].slot] for r in order], [rows[r][1] for r in order],
            None if chains_only else [rows[r][2] for r in order], None if chains_only else [rows[r][3] for r in order],
            sliding_window=self.target.cfg.sliding_window, device=self.device,
        )
        # every tree position's logits; a chunk's last token's only when it ends its prompt
        wanted = [len(rows[r][1]) if r >= len(chunks) else int(len(rows[r][1]) == len(rows[r][0].unprefilled))
                  for r in order]
        taps = self.tap_layers if want_hidden else ()
        out = self.target(batch, self.cache, tap_layers=taps, logits_rows=wanted)
        now = time.monotonic()
        done = {}
        for c, (seq_id, seq, chunk) in enumerate(chunks):
            b = row_of[c]
            start = self.cache.lengths[seq.slot]
            self.cache.commit(seq.slot, range(len(chunk)), chunk)
            del seq.unprefilled[: len(chunk)]
            seq.last_used = now
            if out.hidden_taps is not None:
                taps = out.hidden_taps[b, : len(chunk)]
                seq.prompt_hidden.append(taps)
                self._keep_taps(seq.slot, start, taps)
            if not seq.unprefilled:
                done[seq_id] = self._first_token(seq, out.logits[b, :1])
        results = []
        for i, (seq, tree) in enumerate(zip(seqs, trees)):
            b = row_of[len(chunks) + i]
            raw = out.logits[b, : len(tree) + 1]
            logits = seq.processed(raw, tree, bitmasks[i])  # [n+1, V]: row 0 = root, row j+1 = node j
            if seq.params.greedy:
                result = verify_greedy(tree, logits)
            else:
                result = verify_sampled(tree, logits_to_probs(logits, seq.params), seq.generator)
            kept = [0] + [node + 1 for node in result.accepted_nodes]
            start = self.cache.lengths[seq.slot]
            self.cache.commit(seq.slot, kept, [seq.root_token] + [tree.tokens[node] for node in result.accepted_nodes])
            verified = VerifyOutput(result, None, dead_end=dead_rows[i] is not None and bool(dead_rows[i][kept[-1]]))
            if verified.emitted:
                seq.emitted(verified.emitted)
            seq.last_used = now
            verified.hidden = out.hidden_taps[b, kept] if out.hidden_taps is not None else None
            self._keep_taps(seq.slot, start, verified.hidden)
            if seq.params.wants_log_probs:
                verified.log_probs = token_log_probs(raw, logits, seq.params, kept[: len(verified.emitted)], verified.emitted)
            results.append(verified)
        return done, results

    def _first_token(self, seq: _TargetSequence, last_logits: Tensor) -> PrefillOutput:
        logits = seq.processed(last_logits)[0]
        first = int(logits.argmax()) if seq.params.greedy else sample(logits_to_probs(logits, seq.params), seq.generator)
        seq.emitted([first])
        hidden = torch.cat(seq.prompt_hidden) if seq.prompt_hidden else None
        seq.prompt_hidden = []
        log_probs = token_log_probs(last_logits, logits[None], seq.params, [0], [first]) if seq.params.wants_log_probs else None
        return PrefillOutput(first, hidden, log_probs, seq.cached_tokens)

    def release(self, seq_id: Hashable) -> None:
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self.cache.release(seq.slot)
