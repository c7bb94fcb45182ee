"""Structured output: a request's grammar (JSON, JSON schema, regex, EBNF; TensorRT-LLM's
guided_decoding_guide_type names) enforced on the target at every node of a draft tree,
with xgrammar (the library TensorRT-LLM, vLLM and SGLang use) doing the matching.

Lossless under speculation, for the same reason the logits rules are
(specdec/engine/logits_processing.py): the target's distribution at every tree row is the
one plain constrained decoding would use there, the grammar's token mask for the path from
the committed context to that row. So, per sequence and per step:
- `draft`: drafts the grammar forbids are pruned before the forward (never verified; their
  subtrees go with them), and where the grammar forces a string (a key name, `": "`, a
  closing brace: xgrammar's jump-forward string) its tokens are drafted in front of the
  method's own tree, at no drafter cost (`DraftTree.forced` counts them, so acceptance
  metrics keep them apart). The baseline (no draft budget) gets none: it stays one token
  per forward.
- `mask`: the matcher walks the final tree depth first (accept a node's token, fill its
  row's bitmask, recurse, roll back), the bitmask is applied to the logits, and an
  i.i.d.-sampled tree's draft distributions are masked and renormalised the same way at each
  node's parent (a draw from q that survives pruning is a draw from the masked q, which is
  the q the SpecInfer rule must use).
- `advance`: the committed tokens move the matcher.

Where a rule and the grammar leave a row nothing (min_tokens bans the end token where the
grammar allows only the end; a bad word is the only way on), the grammar wins for that row:
its tokens come back unbanned, so a request always has a way to finish.
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch
from torch import Tensor

import specdec_wire as P
from specdec.config import GUIDE_JSON, GUIDE_JSON_SCHEMA, GUIDE_REGEX, GUIDE_TYPES
from specdec.errors import InvalidRequestError
from specdec.engine.guide_compiler import GuideCompiler
from specdec.engine.tree import ROOT, DraftTree, IID_SAMPLED

_ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


def _xgrammar():
    import xgrammar  # imported on first use: a server without guided requests never loads it

    return xgrammar


def parse_guide(guide_type: str, guide: str | None):
    """The guide's grammar (xgrammar.Grammar), or the refusal naming the field."""
    xgr = _xgrammar()
    try:
        if guide_type == GUIDE_JSON:
            return xgr.Grammar.builtin_json_grammar()
        if guide_type == GUIDE_JSON_SCHEMA:
            return xgr.Grammar.from_json_schema(guide)
        if guide_type == GUIDE_REGEX:
            return xgr.Grammar.from_regex(guide)
        return xgr.Grammar.from_ebnf(guide)
    except (ValueError, RuntimeError, RecursionError) as exc:
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, f"is not a valid {guide_type}: {_first_line(exc)}") from None


def compile_guide(compiler, guide_type: str, guide: str | None):
    """Parse and compile a guide with an xgrammar.GrammarCompiler (in process and in the
    compile probe alike), or the refusal naming the field."""
    grammar = parse_guide(guide_type, guide)
    try:
        compiled = compiler.compile_grammar(grammar)
    except (ValueError, RuntimeError) as exc:
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, f"does not compile: {_first_line(exc)}") from None
    if _starts_at_dead_end(compiled):
        raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, UNPRODUCIBLE)
    return compiled


# A guide that needs a character no token of the vocabulary spells (SmolLM2's has none for
# most ASCII control characters; its tokenizer maps them to <|endoftext|>) reaches a state
# where the grammar allows no token at all: a dead end. Plain constrained decoding would emit
# the tokens that led there and then fail, so that is what a sequence does here: refused at
# compile when it starts at one; otherwise its dead-end row is found among the masks the step
# computes anyway (GuidedSequence.masks), the bonus token that would come from it is not
# emitted, and the sequence ends alone with this error (the round and the others go on).
UNPRODUCIBLE = "needs text that no token of the model's vocabulary can produce (e.g. a control character)"


def _starts_at_dead_end(compiled) -> bool:
    matcher = _xgrammar().GrammarMatcher(compiled)
    bitmask = _xgrammar().allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return not matcher.is_terminated() and not bool(bitmask.any())


def open_dead_ends(bitmask: Tensor) -> Tensor:
    """[rows] bool: the rows of a GuidedSequence.masks bitmask that allow no token (a row past
    the grammar's end allows every token, so it is never one), which are then opened to every
    token (in place) so that the forward's arithmetic stays finite: the caller emits nothing
    drawn from them. Only a leaf's row or the root's can be one: no child survives pruning."""
    dead = ~bitmask.any(dim=-1)
    if bool(dead.any()):
        bitmask[dead] = _ALL_ALLOWED
    return dead


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    # xgrammar's C++ errors start with "[time] file:line: "; the message is what helps.
    for marker in ("Check failed: (error.empty()) is false: ", ".cc:"):
        if marker in text:
            text = text.split(marker, 1)[1]
            text = text.split(": ", 1)[1] if marker == ".cc:" and ": " in text else text
    return text.splitlines()[0][:300]


class Grammars:
    """Compiled grammars for one vocabulary, cached (the same guide gets the same compiled
    object) and bounded (least recently used go first).

    load: returns (xgrammar.TokenizerInfo, tokenize) on first use, so a server that never
    sees a guided request never builds the vocabulary table; tokenize (text -> ids, no
    special tokens) encodes forced strings. compile_timeout_s: the limit on one guide's
    compile (engine.guide_compile_timeout_s; None: no limit and no probe process).

    The scheduler asks `prepare` (a future, compiled on the worker thread) before a guided
    request joins the batch, so `start` on its thread finds the grammar compiled."""

    def __init__(self, load: Callable[[], tuple[object, Callable[[str], list[int]]]], cache_size: int = 64,
                 compile_timeout_s: float | None = None):
        self._load = load
        self._info = None
        self._compiler = None
        self.tokenize: Callable[[str], list[int]] | None = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache and the first load; never held while compiling
        self._forced_ids: OrderedDict[str, list[int]] = OrderedDict()
        self._worker = GuideCompiler(self._compile_uncached, lambda: self._ready_info().serialize_json(), compile_timeout_s)

    @staticmethod
    def for_tokenizer(tokenizer_loader: Callable[[], object], vocab_size: int, compile_timeout_s: float | None = None) -> "Grammars":
        """From a Hugging Face tokenizer (loaded on first use) and the model's vocabulary size
        (the logits' width, which may exceed the tokenizer's)."""
        def load():
            tokenizer = tokenizer_loader()
            info = _xgrammar().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            return info, (lambda text: tokenizer.encode(text, add_special_tokens=False))
        return Grammars(load, compile_timeout_s=compile_timeout_s)

    @property
    def vocab_size(self) -> int:
        return self._ready_info().vocab_size

    def _ready_info(self):
        with self._lock:
            if self._compiler is None:
                self._info, self.tokenize = self._load()
                # One thread: a guide's compile takes at most the one core the worker has.
                self._compiler = _xgrammar().GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._info

    @staticmethod
    def _key(guide_type: str, guide: str | None) -> tuple[str, str]:
        if guide_type not in GUIDE_TYPES:
            raise InvalidRequestError(P.GUIDED_DECODING_GUIDE_TYPE, f"unknown guide type {guide_type!r}; one of {', '.join(GUIDE_TYPES)}")
        return guide_type, "" if guide_type == GUIDE_JSON else guide or ""

    def cached(self, guide_type: str, guide: str | None):
        """The compiled guide if it is in the cache, else None."""
        key = self._key(guide_type, guide)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def prepare(self, guide_type: str, guide: str | None) -> concurrent.futures.Future:
        """A future of the compiled guide, compiled on the worker thread within the limit
        (done at once when cached); its exception names the field when the guide is refused."""
        compiled = self.cached(guide_type, guide)
        if compiled is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(compiled)
            return done
        return self._worker.submit(guide_type, guide)

    def compile(self, guide_type: str, guide: str | None):
        """The compiled guide, compiled here if it is not cached (the scheduler prepares it
        first; tests and tools call this directly)."""
        compiled = self.cached(guide_type, guide)
        return compiled if compiled is not None else self._compile_uncached(guide_type, guide)

    def _compile_uncached(self, guide_type: str, guide: str | None):
        """Parse (the one parse of the guide's grammar) and compile, then cache."""
        key = self._key(guide_type, guide)
        self._ready_info()
        compiled = compile_guide(self._compiler, guide_type, guide)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def warm(self) -> None:
        """Build the vocabulary table and start the probe now (a server at start-up), not
        under the first guided request: both hold the GIL or a core for seconds."""
        self._ready_info()
        self._worker.warm()

    @property
    def compiling(self) -> bool:
        """A guide is compiling now, on a core of its own (the forward gives it one)."""
        return self._worker.busy

    @property
    def probe_kills(self) -> int:
        """Compiles stopped at the limit (each one's request refused)."""
        return self._worker.kills

    def close(self) -> None:
        self._worker.close()

    def start(self, guide_type: str, guide: str | None, end_ids: Sequence[int]) -> "GuidedSequence":
        """A matcher at the grammar's start; end_ids are the tokens that end the sequence
        (the request's end_id or the model's EOS), accepted once the grammar is complete."""
        matcher = _xgrammar().GrammarMatcher(self.compile(guide_type, guide),
                                             override_stop_tokens=list(end_ids) or None)
        return GuidedSequence(matcher, self)

    def forced_ids(self, text: str) -> list[int]:
        ids = self._forced_ids.get(text)
        if ids is None:
            ids = self._forced_ids[text] = list(self.tokenize(text))
            if len(self._forced_ids) > 4096:
                self._forced_ids.popitem(last=False)
        return ids


class GuidedSequence:
    """One sequence's grammar state: the matcher at the committed context."""

    def __init__(self, matcher, grammars: Grammars):
        self.matcher = matcher
        self.grammars = grammars
        self.vocab_size = grammars.vocab_size

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit emitted tokens. Tokens after the grammar's end (a bonus token behind an end
        token that the loop will not output) are not the grammar's."""
        for tok in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(tok)):
                raise AssertionError(f"the grammar refused committed token {tok}: the mask was not applied")

    # ---- before the forward: what to verify ------------------------------------------------
    def draft(self, tree: DraftTree, budget: int, forced: bool) -> DraftTree:
        """The tree to verify: the grammar's forced tokens first (when `forced`), then the
        method's nodes the grammar allows, at most `budget` nodes."""
        chain = self._forced_chain(budget) if forced else []
        allowed = self._allowed_nodes(tree)
        if len(allowed) < len(tree):
            tree = tree.select(allowed)
        if chain:
            tree = tree.with_forced_chain(chain)
        return tree.truncated(budget)

    def _forced_chain(self, budget: int) -> list[int]:
        if budget <= 0 or self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        chain = []
        for tok in self.grammars.forced_ids(text)[:budget]:
            if not self.matcher.accept_token(tok):
                break
            chain.append(tok)
        self.matcher.rollback(len(chain))
        return chain

    def _allowed_nodes(self, tree: DraftTree) -> list[int]:
        """The nodes whose whole path the grammar accepts (ascending)."""
        keep: list[int] = []
        children = tree.children()

        def visit(row: int) -> None:
            for node in children[row]:
                if self.matcher.is_terminated() or not self.matcher.accept_token(tree.tokens[node]):
                    continue
                keep.append(node)
                visit(node + 1)
                self.matcher.rollback(1)

        visit(0)
        return sorted(keep)

    # ---- after the forward: the masks -------------------------------------------------------
    def masks(self, tree: DraftTree | None) -> Tensor:
        """[rows, ceil(V / 32)] int32 bitmask: row 0 at the committed context, row j+1 after
        the path to node j (every node must be allowed: `draft` pruned the rest). A row past
        the grammar's end allows everything (its token is never output)."""
        xgr = _xgrammar()
        rows = 1 + (len(tree) if tree is not None else 0)
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        children = tree.children() if tree is not None else [[]]

        def fill(row: int) -> None:
            if self.matcher.is_terminated():
                bitmask[row] = _ALL_ALLOWED
            else:
                self.matcher.fill_next_token_bitmask(bitmask, row)
            for node in children[row]:
                if self.matcher.is_terminated() or not self.matcher.accept_token(tree.tokens[node]):
                    raise AssertionError(f"tree node {node} ({tree.tokens[node]}) is not allowed: prune before verifying")
                fill(node + 1)
                self.matcher.rollback(1)

        fill(0)
        return bitmask

    def apply(self, logits: Tensor, bitmask: Tensor, unruled: Tensor | None = None) -> Tensor:
        """Mask [rows, V] logits (in place on a float copy). unruled: the same rows before
        the request's logits rules; a row the rules and the grammar together leave empty
        takes the grammar's mask of those instead (the grammar wins)."""
        logits = logits.float().clone() if unruled is None else logits
        width = logits.shape[-1]
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=width)
        if unruled is not None:
            empty = torch.isneginf(logits).all(dim=-1)
            if bool(empty.any()):
                fallback = unruled[empty].float().clone()
                _xgrammar().apply_token_bitmask_inplace(fallback, bitmask[empty.cpu()].to(logits.device), vocab_size=width)
                logits[empty] = fallback
        return logits


def allowed_rows(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[rows, V] bool from an xgrammar bitmask (bit t of word t // 32)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def masked_draft_probs(tree: DraftTree, bitmask: Tensor) -> DraftTree:
    """An i.i.d.-sampled tree with each node's q masked by its parent row's grammar mask and
    renormalised (the distribution the surviving draws were in fact drawn from)."""
    if tree.scheme != IID_SAMPLED or not len(tree):
        return tree
    probs = tree.draft_probs
    allowed = allowed_rows(bitmask, probs.shape[-1]).to(probs.device)
    parent_rows = torch.as_tensor([0 if p == ROOT else p + 1 for p in tree.parents])
    masked = probs * allowed[parent_rows].to(probs.dtype)
    mass = masked.sum(dim=-1, keepdim=True)
    masked = torch.where(mass > 0, masked / mass.clamp_min(1e-30), probs)
    return DraftTree(tree.tokens, tree.parents, masked, tree.scheme, tree.confidence, tree.forced)
