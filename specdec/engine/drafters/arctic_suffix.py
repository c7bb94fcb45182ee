"""Arctic Inference's suffix decoding (`arctic_inference.suffix_decoding.SuffixDecodingCache`,
Snowflake's C++ suffix trees) as a drafter, to compare with ours (`suffix`) in the same
run on the same server. Optional: `arctic_inference` is not a dependency of this project
(its package builds against vLLM and a GPU torch; `specdec/bench/experiments/suffix/build_arctic.sh`
builds only its suffix-tree extension). Not in the shipped specdec.json.

Arctic's cache keeps earlier requests' outputs in one global tree and the active request's
prompt and output in a local one, and drafts from whichever match scores higher. One cache
per cache_salt scope here (LRU, as our corpus), so both methods see the same requests.
Drafts are deterministic trees: verified with the one-hot rule, lossless like any other.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Sequence

from specdec.config import METHOD_ARCTIC_SUFFIX, SpeculativeConfig
from specdec.engine.drafters.base import Drafter
from specdec.engine.drafters.registry import DrafterKind, register
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import ROOT, DraftTree
from specdec.errors import ConfigError


class ArcticSuffixDrafter(Drafter):
    name = "arctic_suffix"

    def __init__(self, config: SpeculativeConfig):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as exc:
            raise ConfigError("method", f"arctic_suffix needs arctic_inference's suffix decoding ({exc}); "
                                        "see specdec/bench/experiments/suffix/build_arctic.sh") from exc
        self.config = config
        self._make = lambda: SuffixDecodingCache(max_tree_depth=config.suffix_max_match, max_cached_requests=10000)
        self._caches: OrderedDict[str | None, object] = OrderedDict()
        self._ids = itertools.count()

    def _cache(self, salt: str | None):
        cache = self._caches.get(salt)
        if cache is None:
            cache = self._caches[salt] = self._make()
            while len(self._caches) > self.config.suffix_scopes:
                self._caches.popitem(last=False)
        self._caches.move_to_end(salt)
        return cache

    def on_prefill(self, seq: SequenceState, hidden) -> None:
        cache, req = self._cache(seq.params.cache_salt), next(self._ids)
        seq.drafter_state[self.name] = (cache, req)
        cache.start_request(req, list(seq.prompt_ids))
        cache.add_active_response(req, list(seq.output_ids))

    def on_verified(self, seq: SequenceState, emitted: list[int], accepted: int, hidden) -> None:
        cache, req = seq.drafter_state[self.name]
        cache.add_active_response(req, list(emitted))

    def on_finish(self, seq: SequenceState) -> None:
        state = seq.drafter_state.pop(self.name, None)
        if state is not None and state[1] in state[0].active_requests:
            state[0].stop_request(state[1])

    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting=None) -> list[DraftTree]:
        out = []
        for seq, budget in zip(seqs, budgets):
            if budget <= 0:
                out.append(DraftTree())
                continue
            cache, req = seq.drafter_state[self.name]
            draft = cache.speculate(req, seq.all_ids[-self.config.suffix_max_match:], max_spec_tokens=budget,
                                    min_token_prob=self.config.suffix_min_token_prob, use_tree_spec=self.config.use_dynamic_tree)
            parents = [ROOT if p < 0 else p for p in draft.parents]
            out.append(DraftTree(list(draft.token_ids), parents, confidence=list(draft.probs)) if draft.token_ids else DraftTree())
        return out


register(DrafterKind(methods=(METHOD_ARCTIC_SUFFIX,), build=lambda spec, ctx: ArcticSuffixDrafter(spec)))
