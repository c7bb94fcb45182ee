"""EAGLE-3: the published checkpoint layout, greedy losslessness (linear and tree), the
EAGLE-2 tree on a hand-checked example, and statistical losslessness of tree sampling."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import save_tiny_hf
from safetensors.torch import save_file
from test_speculative import (
    PARAMS,
    chi_square_p,
    exact_first3,
    prompts,
    run_all,
    sample_first3,
)

from specdec.config import (
    EngineConfig,
    SamplingParams,
    ServingConfig,
    SpeculativeConfig,
)
from specdec.engine.drafters.eagle3 import Eagle3Drafter, _HeadState
from specdec.serving.spec_engine import SpecEngine
from specdec.engine.tree import DraftTree
from specdec.errors import ConfigError
from specdec.engine.models.eagle3_head import Eagle3Config, Eagle3Head, load_eagle3, save_eagle3
from specdec.engine.models.loading import load_transformer
from specdec.engine.sequences import SequenceRecord, SequenceState


def random_published_checkpoint(path, hidden=64, inter=128, heads=4, kv=2, vocab=96, draft_vocab=40, taps=(0, 1, 2)):
    """A checkpoint written the way published EAGLE-3 heads are (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's
    config keys and weight names), with small shapes."""
    g = torch.Generator().manual_seed(0)
    hd = hidden // heads
    r = lambda *s: torch.randn(*s, generator=g) * 0.05
    vocab_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    sd = {
        "fc.weight": r(hidden, 3 * hidden), "norm.weight": 1 + r(hidden), "lm_head.weight": r(draft_vocab, hidden),
        "d2t": vocab_ids - torch.arange(draft_vocab), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, vocab_ids, True),
        "midlayer.hidden_norm.weight": 1 + r(hidden), "midlayer.input_layernorm.weight": 1 + r(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + r(hidden),
        "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * hidden), "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * hidden), "midlayer.self_attn.o_proj.weight": r(hidden, heads * hd),
        "midlayer.mlp.gate_proj.weight": r(inter, hidden), "midlayer.mlp.up_proj.weight": r(inter, hidden),
        "midlayer.mlp.down_proj.weight": r(hidden, inter),
    }
    config = {"architectures": ["LlamaForCausalLMEagle3"], "bias": False, "draft_vocab_size": draft_vocab, "hidden_act": "silu",
              "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 2048,
              "model_type": "llama", "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1,
              "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
              "transformers_version": "4.28.1", "use_cache": True, "vocab_size": vocab,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps)}}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return sd


def save_tiny_target_and_head(root: Path):
    """A tiny target, and a random EAGLE-3 head for it saved in the published layout:
    (target, the head's directory, its weights)."""
    target = load_transformer(save_tiny_hf(root / "target", initializer_range=0.3, seed=3))
    sd = random_published_checkpoint(root / "head")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(root / "head" / "model.safetensors"))
    return target, root / "head", sd


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_target_and_head(tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module")
def two_layer_head(tiny, tmp_path_factory):
    """The tiny head with a second decoder layer (random weights, none zero), saved by
    save_eagle3 and loaded back: its directory."""
    import dataclasses

    target, head_dir, _ = tiny
    one = load_eagle3(head_dir, target.embed, target.cfg)
    two = Eagle3Head(dataclasses.replace(one.cfg, num_hidden_layers=2), target.embed)
    missing, _ = two.load_state_dict(one.state_dict(), strict=False)
    assert missing and all(k.startswith("layers.0.") for k in missing)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, w in two.layers.named_parameters():
            w.copy_(1 + 0.05 * torch.randn(w.shape, generator=g) if "norm" in name else 0.05 * torch.randn(w.shape, generator=g))
    out = tmp_path_factory.mktemp("two_layers") / "head"
    save_eagle3(two, out, dtype=torch.float32)
    return out


def test_published_layout_loads_and_round_trips(tiny, tmp_path):
    target, head_dir, sd = tiny
    head = load_eagle3(head_dir, target.embed, target.cfg)
    assert head.cfg.tap_layers == (0, 1, 2) and head.cfg.draft_vocab_size == 40
    for name, value in head.published_state_dict().items():
        assert torch.equal(value.to(sd[name].dtype), sd[name]), name
    # pytorch_model.bin (the format yuhuili's heads ship in) loads the same way.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((head_dir / "config.json").read_text())
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    again = load_eagle3(tmp_path / "bin", target.embed, target.cfg)
    assert torch.equal(again.attn.wqkv.weight, head.attn.wqkv.weight)
    # ...and save_eagle3 writes the same layout back.
    save_eagle3(head, tmp_path / "saved", dtype=torch.float32)
    third = load_eagle3(tmp_path / "saved", target.embed, target.cfg)
    assert torch.equal(third.lm_head.weight, head.lm_head.weight) and torch.equal(third.d2t, head.d2t)
    del sd["norm.weight"]
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "bin" / "model.safetensors"))
    with pytest.raises(Exception, match="norm.weight"):
        load_eagle3(tmp_path / "bin", target.embed, target.cfg)


def test_absorb_equals_the_last_position_of_a_padded_pass(tiny):
    """The head's catch-up pass (packed rows, the draft vocabulary projected at each row's
    last pair only) gives the hidden state and draft logits the full padded pass gives there,
    and leaves the same keys in the head's cache."""
    from specdec.engine.models.llama import build_batch

    target, head_dir, _ = tiny
    head = load_eagle3(head_dir, target.embed, target.cfg)
    g = torch.Generator().manual_seed(1)
    lengths = (5, 12, 1)
    rows = [torch.randn(n, 3 * head.cfg.hidden_size, generator=g) for n in lengths]
    tokens = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    caches, outs = [], []
    for packed in (True, False):
        cache = head.new_cache(3, 64, 16)
        slots = [cache.allocate() for _ in lengths]
        batch = build_batch(slots, [0] * 3, tokens)
        if packed:
            outs.append(head.absorb(rows, batch, cache))
        else:
            padded = torch.zeros(3, max(lengths), rows[0].shape[-1])
            for b, r in enumerate(rows):
                padded[b, : len(r)] = r
            hidden, logits = head(padded, batch, cache)
            last = torch.tensor([n - 1 for n in lengths])
            outs.append((hidden[torch.arange(3), last], logits[torch.arange(3), last]))
        caches.append(cache)
    (h_packed, l_packed), (h_padded, l_padded) = outs
    assert torch.allclose(h_packed, h_padded, atol=1e-5) and torch.allclose(l_packed, l_padded, atol=1e-5)
    for b, n in enumerate(lengths):
        assert torch.allclose(caches[0].k[0][b, :, :n], caches[1].k[0][b, :, :n], atol=1e-5)


def test_a_two_layer_head_round_trips_in_both_layouts(tiny, two_layer_head, tmp_path):
    """num_hidden_layers 2: the second layer as `layers.1.*` (Llama names) in our layout and
    in speculators' (where the first is `layers.0.*`), the same tensors back from each; a
    config that counts fewer layers than the weights hold is refused, naming the key."""
    from safetensors.torch import load_file

    from specdec.engine.models.eagle3_head import export_speculators

    target = tiny[0]
    head = load_eagle3(two_layer_head, target.embed, target.cfg)
    assert head.cfg.num_hidden_layers == 2 and len(head.layers) == 1 and head.new_cache(1, 8, 4).k.shape[0] == 2
    saved = load_file(str(two_layer_head / "model.safetensors"))
    assert "layers.1.self_attn.q_proj.weight" in saved and "layers.1.mlp.down_proj.weight" in saved
    for name, value in head.published_state_dict().items():
        assert torch.equal(value, saved[name]), name
    exported = export_speculators(two_layer_head, tmp_path / "speculators")
    config = json.loads((exported / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert {"layers.0.hidden_norm.weight", "layers.1.input_layernorm.weight"} <= set(load_file(str(exported / "model.safetensors")))
    again = load_eagle3(exported, target.embed, target.cfg)
    for name, value in again.published_state_dict().items():
        assert torch.equal(value, saved[name]), name
    raw = json.loads((two_layer_head / "config.json").read_text())
    (tmp_path / "fewer").mkdir()
    (tmp_path / "fewer" / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1}))
    save_file(saved, str(tmp_path / "fewer" / "model.safetensors"))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_eagle3(tmp_path / "fewer", target.embed, target.cfg)


@pytest.mark.parametrize("layers", [1, 2])
def test_drafting_passes_equal_the_training_unroll(tiny, two_layer_head, layers):
    """What drafting computes is what training-time test trains: the catch-up pass over a
    committed prefix and two chained draft passes from the head's cache give, at the prefix's
    last position, the logits and carried hidden of TTT steps 0, 1 and 2 (with one decoder
    layer and with two, whose second layer keeps its own cache layer)."""
    from specdec.engine.drafters.tree_search import draft_pass_batch
    from specdec.engine.models.llama import build_batch

    target, head_dir, _ = tiny
    head = load_eagle3(head_dir if layers == 1 else two_layer_head, target.embed, target.cfg)
    g = torch.Generator().manual_seed(3)
    T, steps = 7, 3
    taps = torch.randn(T, 3 * head.cfg.hidden_size, generator=g)
    next_tokens = torch.randint(0, 96, (T + steps,), generator=g)
    with torch.no_grad():
        unrolled = head.ttt_forward(taps[None], next_tokens[None], steps)
    cache = head.new_cache(1, 32, 8)
    slot = cache.allocate()
    hidden, logits = head.absorb([taps], build_batch([slot], [0], [next_tokens[:T].tolist()]), cache)
    cache.commit(slot, range(T))
    assert torch.allclose(logits[0], unrolled[0][0, T - 1], atol=1e-5)
    for depth in range(1, steps):
        batch = draft_pass_batch([T], [slot], [[int(next_tokens[T + depth - 1])]], [depth - 1], [[depth - 1]],
                                 [torch.ones(1, depth, dtype=torch.bool)], "cpu")
        hidden, logits = head(hidden[:, None], batch, cache)
        hidden, logits = hidden[:, 0], logits[:, 0]
        assert torch.allclose(logits[0], unrolled[depth][0, T - 1], atol=1e-5), depth


def eagle_engine(target, head_dir, max_batch=8):
    cfg = EngineConfig(max_batch_size=max_batch, max_seq_len=128, max_num_draft_tokens=8)
    head = load_eagle3(head_dir, target.embed, target.cfg)
    drafters = {
        "eagle3": Eagle3Drafter(head, SpeculativeConfig(method="eagle3", max_draft_len=5), max_batch, 128),
        "eagle3-tree": Eagle3Drafter(head, SpeculativeConfig(method="eagle3-tree", max_draft_len=3, use_dynamic_tree=True,
                                                             dynamic_tree_max_topK=3, max_total_draft_tokens=8), max_batch, 128),
        # Planned budgets, and n-gram continuations merged into the head's tree.
        "eagle3-hybrid": Eagle3Drafter(head, SpeculativeConfig(
            method="eagle3", max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=3, max_total_draft_tokens=8,
            adaptive=True, hybrid_ngram=True), max_batch, 128),
        "eagle3-adaptive": Eagle3Drafter(head, SpeculativeConfig(method="eagle3", max_draft_len=5, adaptive=True), max_batch, 128),
    }
    return SpecEngine(target, cfg, drafters=drafters)


@pytest.mark.parametrize("layers", [1, 2])
def test_greedy_eagle3_equals_plain_tiny(tiny, two_layer_head, layers):
    target, head_dir, _ = tiny
    head_dir = head_dir if layers == 1 else two_layer_head
    ps = prompts(12, seed=5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = eagle_engine(target, head_dir)
    plain = run_all(engine, ps, params, "none", 0, concurrent=1)
    for method, k in (("eagle3", 5), ("eagle3-tree", 8), ("eagle3-hybrid", 8), ("eagle3-adaptive", 5)):
        for concurrent in (1, 8):
            assert run_all(engine, ps, params, method, k, concurrent) == plain, (method, concurrent)
    assert engine.cache.num_free == 8
    assert all(d.cache.num_free == 8 for d in engine.drafts.drafters.values())


def test_merged_continuation_shares_prefixes_and_keeps_children_distinct():
    tree = DraftTree([5, 6, 7], [-1, 0, -1], confidence=[0.9, 0.5, 0.1])
    merged = tree.merged([5, 8, 9])
    assert merged.tokens == [5, 6, 7, 8, 9] and merged.parents == [-1, 0, -1, 0, 3]
    assert merged.confidence[:3] == [0.9, 0.5, 0.1] and all(c != c for c in merged.confidence[3:])
    assert tree.merged([7]).tokens == tree.tokens  # already there: nothing added
    kids = merged.children()
    assert all(len({merged.tokens[c] for c in k}) == len(k) for k in kids)


def test_a_continuation_joins_sampled_draws_first_as_one_hot_rows():
    """Sampled chain 5 -> 6 (q rows a, b) and 7 under the root (row c), continuation 5 -> 8:
    the continuation's nodes come first with one-hot rows; the sampled 5 stays as a leaf
    (its rejection step) after the continuation's 5, its sampled child 6 hangs below the
    continuation's 5 with its own row."""
    from specdec.engine.tree import IID_SAMPLED

    q = torch.softmax(torch.randn(3, 10), -1)
    tree = DraftTree([5, 6, 7], [-1, 0, -1], q, IID_SAMPLED)
    merged = tree.merged([5, 8])
    assert merged.scheme == IID_SAMPLED
    assert merged.tokens == [5, 8, 5, 6, 7] and merged.parents == [-1, 0, -1, 0, -1]
    assert torch.equal(merged.draft_probs[0], torch.nn.functional.one_hot(torch.tensor(5), 10).float())
    assert torch.equal(merged.draft_probs[1], torch.nn.functional.one_hot(torch.tensor(8), 10).float())
    assert [torch.equal(merged.draft_probs[n], q[r]) for n, r in ((2, 0), (3, 1), (4, 2))] == [True] * 3
    assert merged.children()[0] == [0, 2, 4] and merged.children()[1] == [1, 3]  # the continuation is tried first


def test_a_sampled_draw_equal_to_the_continuation_keeps_its_rejection_step():
    """Exact case where dropping the joined draw's rejection step is lossy: root target
    p = (.2, .4, .4), draft q = (.5, .5, 0), continuation [0]. Without the step the first
    emitted token would be distributed (.2, .6, .2); with it, p."""
    from specdec.engine.acceptance import verify_sampled
    from specdec.engine.sampling import sample
    from specdec.engine.tree import IID_SAMPLED

    p, q = torch.tensor([0.2, 0.4, 0.4]), torch.tensor([0.5, 0.5, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = [0, 0, 0]
    for _ in range(6000):
        tree = DraftTree([sample(q, gen)], [-1], q[None], IID_SAMPLED).merged([0])
        counts[verify_sampled(tree, p.expand(len(tree) + 1, 3), gen).emitted[0]] += 1
    pvalue = chi_square_p(np.array(counts, dtype=float), p.double().numpy())
    assert pvalue > 1e-3, f"first token {counts} vs p = {p.tolist()}: chi-square p={pvalue:.2e}"


def test_sampled_tree_shape_follows_only_earlier_draws():
    """tree_search.sampled_trees on scripted draws (top-k 2, mass .75, budget 6, depth 3):
    the root draws 0 then 1 (covered .8: stop); node 0 draws 3 (.9: stop); node 1 draws 4
    twice (the duplicate is kept as a leaf and ends its draws); the next level grows the
    best non-duplicates (3|0, then 4|1) until the budget ends the tree at 5|3. Rows are q
    at each node's parent, in draw order."""
    from specdec.engine.drafters.tree_search import sampled_trees
    from specdec.engine.tree import IID_SAMPLED

    q = {"root": torch.tensor([.5, .3, .2, 0, 0, 0]), 0: torch.tensor([0, 0, 0, .9, .1, 0]),
         1: torch.tensor([0, 0, 0, .4, .4, .2]), 2: torch.tensor([0, 0, 0, 0, 0, 1.0]), 3: torch.tensor([1.0, 0, 0, 0, 0, 0])}
    script = iter([0, 1, 3, 4, 4, 5])
    expanded = []

    def expand(rows):
        expanded.append((rows[0].nodes, rows[0].level))
        return torch.stack([q[n].clamp(min=1e-30).log() for n in rows[0].nodes])[None]

    tree = sampled_trees([q["root"]], expand, lambda b, logits: torch.softmax(logits, -1), lambda b, dist: next(script),
                         top_k=2, max_depth=3, budgets=[6], mass=0.75)[0]
    assert tree.scheme == IID_SAMPLED
    assert tree.tokens == [0, 1, 3, 4, 4, 5] and tree.parents == [-1, -1, 0, 1, 1, 2]
    assert expanded == [([0, 1], 0), ([2, 3], 1)]
    for node, row in enumerate(["root", "root", 0, 1, 1, 2]):
        assert torch.allclose(tree.draft_probs[node], q[row], atol=1e-6), node


class TableHead(Eagle3Head):
    """A head whose next-token log-probs depend only on the input token (a lookup table)."""

    def __init__(self, cfg, embed, table):
        super().__init__(cfg, embed)
        self.table = table

    def forward(self, hidden, batch, cache):
        return torch.zeros(*batch.tokens.shape, self.cfg.hidden_size), self.table[batch.tokens].log()


def test_dynamic_tree_matches_hand_checked_tree(tiny):
    target, _, _ = tiny
    eps = 1e-6
    table = torch.full((6, 6), eps)
    for token, row in {0: [0, 0, 0, .7, .2, .1], 1: [0, 0, 0, .1, .5, .4], 3: [.9, .06, .04, 0, 0, 0],
                       4: [.5, .3, .2, 0, 0, 0], 5: [.6, .3, .1, 0, 0, 0]}.items():
        table[token] = torch.tensor(row) + eps
    table = table / table.sum(-1, keepdim=True)
    cfg = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=96, draft_vocab_size=6, tap_layers=(0, 1, 2))
    head = TableHead(cfg, target.embed, table)  # d2t = 0: draft id == target id
    spec = SpeculativeConfig(method="eagle3-tree", max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2)
    assert spec.max_total_draft_tokens == 6
    drafter = Eagle3Drafter(head, spec, 2, 64)
    seq = SequenceState(SequenceRecord("s", [1, 2], SamplingParams(), "eagle3-tree", output_ids=[7]), torch.Generator())
    state = _HeadState(drafter.cache.allocate(), last_hidden=torch.zeros(64), last_logits=torch.tensor([.6, .3, .1, eps, eps, eps]).log())
    seq.drafter_state["eagle3"] = state
    # Depth 1: 0 (.6), 1 (.3). Depth 2: 3|0 (.42), 4|1 (.15), 4|0 (.12), 5|1 (.12) -> frontier 3|0, 4|1.
    # Depth 3: 0|3 (.378), 1|3 (.0252), 0|4 (.075), 1|4 (.045). Best 5: .6 .42 .378 .3 .15.
    tree = drafter.propose([seq], [5])[0]
    assert tree.tokens == [0, 1, 3, 4, 0] and tree.parents == [-1, -1, 0, 1, 2]
    tree = drafter.propose([seq], [2])[0]  # the budget caps the tree, parents first
    assert tree.tokens == [0, 3] and tree.parents == [-1, 0]


@pytest.fixture(scope="module")
def toy_eagle(tmp_path_factory):
    from test_speculative import TOY_VOCAB

    root = tmp_path_factory.mktemp("toy_eagle")
    target = load_transformer(
        save_tiny_hf(root / "t", vocab_size=TOY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     initializer_range=0.15, seed=11, eos_token_id=0, bos_token_id=0)
    )
    sd = random_published_checkpoint(root / "h", hidden=32, inter=64, heads=4, kv=2, vocab=TOY_VOCAB, draft_vocab=TOY_VOCAB - 2,
                                     taps=(0, 1, 1))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 40  # peaked draft distributions
    save_file({k: v.contiguous() for k, v in sd.items()}, str(root / "h" / "model.safetensors"))
    return target, load_eagle3(root / "h", target.embed, target.cfg)


class _CountingEagle3(Eagle3Drafter):
    """The real drafter; counts the nodes it proposed (sample_first3 checks that the planner
    verified fewer)."""

    proposed = 0
    branching = 0  # trees with a node (or the root) of two or more children
    iid = 0  # trees drafted under the i.i.d. rule

    def propose(self, seqs, budgets, keep_drafting=None):
        from specdec.engine.tree import IID_SAMPLED

        trees = super().propose(seqs, budgets, keep_drafting)
        self.proposed += sum(len(t) for t in trees)
        self.branching += sum(any(len(k) > 1 for k in t.children()) for t in trees)
        self.iid += sum(t.scheme == IID_SAMPLED for t in trees)
        return trees


# Sampled checks by chi-square (make test-all, ~4 min on 2 cores): the same paths at their
# shipped settings are proved exactly in make test by tests/engine/test_exact_lossless.py, which
# enumerates every random outcome instead of sampling (power 1 against the controls there).
@pytest.mark.slow
@pytest.mark.parametrize("tree", [pytest.param("chain", id="chain_sampled"), "dynamic_tree", "sampled_tree"])
def test_eagle3_sampling_is_lossless(toy_eagle, tree):
    """chain: sampled chains (i.i.d. rule); dynamic_tree: EAGLE-2 top-k trees (one-hot rule);
    sampled_tree: trees drawn from q whose shape follows the draws (i.i.d. rule), which must
    branch for the test to mean anything."""
    target, head = toy_eagle
    spec = {"chain": SpeculativeConfig(method="eagle3", max_draft_len=4),
            "dynamic_tree": SpeculativeConfig(method="eagle3-tree", max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2),
            "sampled_tree": SpeculativeConfig(method="eagle3-tree", max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2,
                                              sampled_tree=True, sampled_tree_mass=1.0)}[tree]
    drafter = _CountingEagle3(head, spec, 500, 32)
    counts = sample_first3(target, drafter, PARAMS, seed0=2000)
    p = chi_square_p(counts, exact_first3(target, PARAMS))
    assert p > 1e-3, f"chi-square p={p:.2e}"
    if tree == "sampled_tree":
        assert drafter.branching > 0 and drafter.iid, "no sampled tree branched"


def test_serving_config_checks_eagle_budgets():
    base = {"engine": {"max_num_draft_tokens": 8}, "methods": {}}
    with pytest.raises(ConfigError, match="methods.eagle3-tree.max_total_draft_tokens"):
        ServingConfig.from_dict({**base, "methods": {"eagle3-tree": {"method": "eagle3-tree", "max_draft_len": 4,
                                                                      "use_dynamic_tree": True, "dynamic_tree_max_topK": 4}}})
    with pytest.raises(ConfigError, match="max_total_draft_tokens"):
        SpeculativeConfig(method="eagle3-tree", max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=2, max_total_draft_tokens=9)
    with pytest.raises(ConfigError, match="default_method"):
        ServingConfig.from_dict({**base, "default_method": "eagle3"})
    with pytest.raises(ConfigError, match="methods.x.max_depth"):
        ServingConfig.from_dict({**base, "methods": {"x": {"method": "eagle3", "max_depth": 3}}})


def test_train_eagle3_quick_mode_writes_a_loadable_head(tmp_path, smol_model):
    """The whole training pipeline on a tiny budget: features, vocabulary, TTT training,
    held-out evaluation, a head in the published layout with its model card; then Medusa
    heads trained on the same cached features."""
    from specdec.training.train_eagle3 import main as train_main

    out = tmp_path / "head"
    assert train_main(["--quick", "--out", str(out), "--features-dir", str(tmp_path / "features")]) == 0
    record = json.loads((out / "train_log.json").read_text())
    assert record["budget"]["optimizer_steps"] >= 1 and record["data"]["train_tokens"] > 0
    assert len(record["heldout_top1_by_position"]) == 3 and "mean_acceptance_length" in record["heldout_acceptance"]
    assert (out / "README.md").is_file()
    head = load_eagle3(out, smol_model.embed, smol_model.cfg)
    assert head.cfg.draft_vocab_size == 2048 and int(head.t2d.sum()) == 2048
    assert torch.equal(head.draft_to_target[head.t2d[head.draft_to_target]], head.draft_to_target)
    # Medusa heads from the same feature cache (its last-layer column), the same way.
    from specdec.engine.models.medusa_heads import load_medusa
    from specdec.training.train_medusa import main as train_medusa

    assert train_medusa(["--quick", "--num-heads", "3", "--out", str(tmp_path / "medusa"), "--features-dir", str(tmp_path / "features")]) == 0
    record = json.loads((tmp_path / "medusa" / "train_log.json").read_text())
    assert record["budget"]["optimizer_steps"] >= 1 and len(record["heldout_top1_by_head"]) == 3
    heads = load_medusa(tmp_path / "medusa", smol_model.cfg)
    assert heads.cfg.num_heads == 3 and heads.cfg.source_layer == smol_model.cfg.num_layers - 1
    assert (tmp_path / "medusa" / "README.md").is_file()


def test_self_distilled_features_equal_a_fresh_target_pass(tmp_path, smol_model, smol_tokenizer):
    """Features recorded while the target answers (taps the verifier hands to drafters)
    are the ones a separate teacher-forced pass computes, labels are the target's argmax on
    the answer and absent on the prompt, and benchmark prompts are never used."""
    from specdec.training.capture import self_distilled_features, target_features
    from specdec.training.data import benchmark_prompt_texts

    feats = self_distilled_features(smol_model, smol_tokenizer, 3, 12, 0, set(), tmp_path / "sd", batch=2, shard=2)
    assert len(feats) == 3 and len(list((tmp_path / "sd").glob("shard_*.pt"))) == 2
    reserved = benchmark_prompt_texts()
    for f in feats:
        ref = target_features(smol_model, [f["tokens"].tolist()])[0]
        answer = f["labels"] >= 0
        assert f["taps"].shape == ref["taps"].shape and f["last"].shape == ref["last"].shape
        assert f["taps"].shape[-1] == 3 * f["last"].shape[-1]
        assert torch.allclose(f["taps"].float(), ref["taps"].float(), atol=0.05)
        assert torch.allclose(f["last"].float(), ref["last"].float(), atol=0.05, rtol=2e-3)  # values near 100: fp16 steps of 0.06
        assert 1 <= int(answer.sum()) <= 12 and not bool(answer[0])
        assert torch.equal(f["labels"][answer], ref["labels"][answer])
        prompt = smol_tokenizer.decode(f["tokens"][: int((~answer).sum()) + 1].tolist())
        assert not any(text in prompt for text in list(reserved)[:50] if len(text) > 20)
    again = self_distilled_features(smol_model, smol_tokenizer, 3, 12, 0, set(), tmp_path / "sd", batch=2, shard=2)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(feats, again))  # resumed from the shards


def test_stored_answers_give_the_recorded_features(tmp_path, smol_model, smol_tokenizer):
    """distill-answers keeps only token ids; their teacher-forced features (answer_features)
    label exactly the answer positions with the answer's own tokens (greedy), as features
    recorded while generating do, and are cached per answer shard."""
    from specdec.training.capture import answer_features, self_distilled_features
    from specdec.training.data import distill_prompts, load_answers, save_shard
    from specdec.training.distill_answers import greedy_answers

    prompts = distill_prompts(smol_tokenizer, 3, 0, set())
    assert prompts == distill_prompts(smol_tokenizer, 3, 0, set(), draw=3 + 64)[:3]  # the order does not depend on the draw
    answers = greedy_answers(smol_model, smol_tokenizer, prompts, 12, batch=2)
    (tmp_path / "ans").mkdir()
    save_shard(tmp_path / "ans" / "shard_00000.npz", [0, 1], prompts[:2], answers[:2])
    save_shard(tmp_path / "ans" / "shard_00001.npz", [2], prompts[2:], answers[2:])
    assert [(i, pr, a) for i, pr, a in load_answers(tmp_path / "ans")] == [(i, prompts[i], answers[i]) for i in range(3)]
    feats = answer_features(smol_model, tmp_path / "ans", tmp_path / "feat")
    assert len(list((tmp_path / "feat").glob("*.pt"))) == 2
    recorded = {tuple(f["tokens"].tolist()): f for f in self_distilled_features(smol_model, smol_tokenizer, 3, 12, 0, set(), tmp_path / "sd",
                                                                                  batch=2, shard=2)}
    for f in feats:
        i = f["prompt_index"]
        n = len(prompts[i])
        assert f["tokens"].tolist() == prompts[i] + answers[i]
        assert (f["labels"][: n - 1] == -1).all() and f["labels"][-1] == -1
        assert f["labels"][n - 1 : -1].tolist() == answers[i]  # greedy: the target's argmax is the answer
        ref = recorded[tuple(f["tokens"][:-1].tolist())]  # the recorder stops before the last token
        assert torch.equal(f["labels"][:-1], ref["labels"])
        assert torch.allclose(f["taps"][:-1].float(), ref["taps"].float(), atol=0.05)
    assert len(answer_features(smol_model, tmp_path / "ans", tmp_path / "feat", first_prompt=2)) == 1


def test_stored_answers_keep_their_targets_ids_apart(tmp_path):
    """A target with more than 2**16 ids (Gemma 3's 262,144) stores them whole; its shards
    record its vocabulary and another target refuses them; the default target keeps its
    directory name and another target's answers get their own."""
    import numpy as np

    from specdec.training.data import answers_dir, load_shard, save_shard

    big = [[5, 70_000, 262_143]]
    save_shard(tmp_path / "shard_00000.npz", [0], big, [[262_000, 1]], vocab_size=262_144)
    assert np.load(tmp_path / "shard_00000.npz")["prompt_ids"].dtype == np.uint32
    assert load_shard(tmp_path / "shard_00000.npz", 262_144) == [(0, big[0], [262_000, 1])]
    with pytest.raises(ValueError, match="another target"):
        load_shard(tmp_path / "shard_00000.npz", 49_152)
    save_shard(tmp_path / "shard_00001.npz", [0], [[5, 6]], [[7]])  # recorded without a vocabulary (the older shards)
    with pytest.raises(ValueError, match="another target"):
        load_shard(tmp_path / "shard_00001.npz", 6)  # an id past the reader's vocabulary
    with pytest.raises(ValueError, match="vocab_size"):
        save_shard(tmp_path / "shard_00002.npz", [0], big, [[1]])
    assert answers_dir(192, 0).name == "smollm2-135m-greedy-t192-seed0"
    assert answers_dir(128, 0, 2, "gemma3-270m").name == "gemma3-270m-greedy-t128-seed0-turn2"


def test_second_turn_prompts_are_a_stable_order_apart_from_what_is_measured(smol_tokenizer):
    """distill-answers --turn 2 (the first-turn prompts ran out): turn one, its dataset answer and
    turn two, in an order that does not depend on n, never a conversation whose first prompt the
    benchmarks reserve (bench-head-acceptance's multi-turn workload) or whose opening is held out."""
    from specdec.bench.head_acceptance import multi_turn_prompts
    from specdec.training.data import benchmark_prompt_texts, second_turn_prompts, user_openings

    prompts = second_turn_prompts(smol_tokenizer, 6, 0, set())
    assert len(prompts) == 6 and prompts[:3] == second_turn_prompts(smol_tokenizer, 3, 0, set())
    header = smol_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for ids in prompts:
        text = smol_tokenizer.decode(ids)
        assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2, text[:200]
        assert ids[-len(header):] == header  # ends where the answer starts
    measured = {tuple(ids) for ids in multi_turn_prompts(smol_tokenizer, 32, set())}
    assert measured and not measured & {tuple(ids) for ids in second_turn_prompts(smol_tokenizer, 200, 0, set())}
    reserved = benchmark_prompt_texts()
    assert not any(smol_tokenizer.decode(ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0].strip() in reserved
                   for ids in prompts)
    held = {tuple(o) for o in user_openings(prompts[:2], smol_tokenizer)}  # hold two openings out: they go
    kept = second_turn_prompts(smol_tokenizer, 6, 0, held)
    assert prompts[0] not in kept and prompts[1] not in kept and kept[:4] == prompts[2:]


def test_draft_len_schedule_and_max_concurrency_semantics():
    """TensorRT-LLM's meaning: {4: 4, 8: 2, 32: 1} -> batch 1-4: 4, 5-8: 2, 9-32: 1, 33+: 0."""
    spec = SpeculativeConfig(method="eagle3", max_draft_len=5, draft_len_schedule={"4": 4, "8": 2, "32": 1})
    assert spec.draft_len_schedule == {4: 4, 8: 2, 32: 1}
    assert [spec.scheduled_draft_tokens(5, b) for b in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    assert spec.scheduled_draft_tokens(3, 1) == 3  # never more than the request asks
    capped = SpeculativeConfig(method="ngram", max_concurrency=2)
    assert [capped.scheduled_draft_tokens(4, b) for b in (1, 2, 3)] == [4, 4, 0]
    with pytest.raises(ConfigError, match="draft_len_schedule"):
        SpeculativeConfig(draft_len_schedule={"x": 2})
    with pytest.raises(ConfigError, match="draft_len_schedule"):
        SpeculativeConfig(draft_len_schedule={4: -1})
    with pytest.raises(ConfigError, match="max_concurrency"):
        SpeculativeConfig(max_concurrency=0)
    raw = {"engine": {}, "methods": {"e": {"method": "eagle3", "max_concurrency": 4, "draft_len_schedule": {"2": 3}}}}
    assert ServingConfig.from_dict(raw).methods["e"].scheduled_draft_tokens(5, 2) == 3


def test_load_controls_skip_drafting_and_stay_lossless(tiny):
    """With a schedule, crowded steps draft nothing (the drafter is not even called); EAGLE-3
    catches up on the skipped steps' hidden states when drafting resumes; greedy output is
    unchanged."""
    target, head_dir, _ = tiny
    ps = prompts(8, seed=7)
    engine = eagle_engine(target, head_dir)
    spec = SpeculativeConfig(method="eagle3", max_draft_len=5, draft_len_schedule={3: 5, 5: 1})
    engine.drafts.drafters["eagle3"].config = spec
    seen: list[tuple[int, list[int]]] = []
    propose = engine.drafts.propose
    engine.drafts.propose = lambda items, cut_for=None: seen.append((len(engine.sequences), [b for _, b in items])) or propose(items, cut_for)
    results: dict[int, list[int]] = {}
    for i, p in enumerate(ps):  # different lengths, so the batch shrinks as requests finish
        engine.add_request(str(i), p, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True), "eagle3", 5)
        results[i] = []
    while engine.has_work():
        for out in engine.step():
            results[int(out.request_id)] += out.new_token_ids
    plain = [run_all(engine, [p], SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True), "none", 0, 1)[0] for i, p in enumerate(ps)]
    assert [results[i] for i in range(8)] == plain
    assert seen and all(n <= 5 for n, _ in seen)  # a crowded step never calls the drafter
    assert all(0 < b <= (1 if n > 3 else 5) for n, budgets in seen for b in budgets)
    assert 1 in {b for _, budgets in seen for b in budgets} and any(b > 1 for _, budgets in seen for b in budgets)
    assert all(d.cache.num_free == 8 for d in engine.drafts.drafters.values())


def _loop_generate(backend, prompt, method, keepalive=60.0, colocated=True):
    import asyncio

    from loop_driver import run_loop
    from specdec.serving.state import RequestState

    async def go():
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        req = RequestState("r", list(prompt), params, method, 5, 128, frozenset())
        async for _ in run_loop(req, backend, not colocated, drafter_keepalive_s=keepalive, colocated=colocated):
            pass
        return req.output_ids

    return asyncio.run(go())


def test_run_loop_colocated_is_one_call_per_step_and_lossless(tiny):
    """The serving loop over the in-process backend, drafters beside the target: every step
    is ONE verify call (the drafter is never called apart), greedy output equals plain
    decoding, and the slots are freed."""
    from specdec.serving.inprocess import InProcessBackend

    target, head_dir, _ = tiny
    engine = eagle_engine(target, head_dir)

    class Counting(InProcessBackend):  # counts verify calls; start_drafter / draft would raise
        calls: list[int] = []

        async def verify(self, tree, want_hidden):
            out = await super().verify(tree, want_hidden)
            self.calls.append(out.draft_tokens)
            return out

    for method in ("eagle3", "eagle3-tree"):
        for p in prompts(3, seed=13):
            plain = run_all(engine, [p], SamplingParams(max_tokens=24, ignore_eos=True), "none", 0, 1)[0]
            backend = Counting(engine.speculator, "r")
            backend.calls = []
            assert _loop_generate(backend, p, method) == plain
            assert len(backend.calls) >= 1 and sum(backend.calls) > 0  # one call per step, and it verified drafts
    assert engine.speculator.active == 0 and engine.cache.num_free == 8
    assert all(d.cache.num_free == 8 for d in engine.drafts.drafters.values())


def test_run_loop_hands_skipped_steps_to_a_separate_drafter_merged(tiny):
    """A drafter served apart, with a verifier that budgets every third step only: the
    drafter drafts what the verifier's reply allows, gets the skipped replies merged, and
    greedy output equals plain decoding."""
    from specdec.engine.drafters.service import DraftService
    from specdec.serving.inprocess import InProcessBackend
    from specdec.serving.drafter_apart import merge_replies
    from specdec.engine.speculator import Speculator, StepResult

    target, head_dir, _ = tiny
    engine = eagle_engine(target, head_dir)
    drafts = DraftService(engine.drafts.drafters)

    class Scheduled(Speculator):
        """Budgets only the steps `drafts_at` picks (counted from the prefill's decision)."""

        drafts_at, decisions = (lambda step: True), 0

        def _decide_budget(self, seq):
            budget = super()._decide_budget(seq) if self.drafts_at(self.decisions) else 0
            self.decisions += 1
            seq.budget = budget
            return budget

    speculator = Scheduled(target, engine.config, {}, apart_tap_layers=drafts.tap_layers)

    class Separate(InProcessBackend):
        def __init__(self):
            super().__init__(speculator, "r", drafts)
            self.drafted, self.verified = [], []

        async def start_target(self, *args):
            out = await super().start_target(*args)
            self.verified += out.emitted
            return out

        async def draft(self, last, num_draft_tokens):
            self.drafted.append(len(last.emitted))
            tree = await super().draft(last, num_draft_tokens)
            assert drafts._get(self.seq_id).output_ids == self.verified  # nothing lost or doubled
            return tree

        async def verify(self, tree, want_hidden):
            out = await super().verify(tree, want_hidden)
            self.verified += out.emitted
            return out

    ps = prompts(4, seed=11)
    for p in ps:
        plain = run_all(engine, [p], SamplingParams(max_tokens=24, ignore_eos=True), "none", 0, 1)[0]
        backend = Separate()
        speculator.drafts_at, speculator.decisions = (lambda step: step % 3 == 0), 0
        assert _loop_generate(backend, p, "eagle3", colocated=False) == plain
        assert backend.drafted and max(backend.drafted) >= 3  # three steps' tokens arrived at once
    # Never drafting, but a keep-alive of 0 s: the drafter still hears of every step.
    backend = Separate()
    speculator.drafts_at = lambda step: False
    out = _loop_generate(backend, ps[0], "eagle3", keepalive=0.0, colocated=False)
    assert out == run_all(engine, [ps[0]], SamplingParams(max_tokens=24, ignore_eos=True), "none", 0, 1)[0]
    assert len(backend.drafted) == 22 and set(backend.drafted) == {1}  # 23 verify steps, the first one after start_drafter
    assert speculator.active == 0 and drafts.active == 0
    merged = merge_replies([StepResult([1, 2], 1, hidden=torch.zeros(2, 3)), StepResult([3], 0, hidden=torch.ones(1, 3))])
    assert merged.emitted == [1, 2, 3] and merged.accepted == 1 and merged.hidden.shape == (3, 3)


@pytest.mark.slow  # ~1 min; the acceptance floor and test_methods_served hold the shipped head in make test
def test_shipped_head_greedy_identity_on_sharegpt(smol_model, smol_tokenizer):
    """The SHIPPED head (not a random one) on 16 ShareGPT first turns: token ids equal plain
    decoding's, batched, with every draft position accepted at least once (so the deep
    acceptance path runs with real drafts)."""
    from specdec.tools.sharegpt import sharegpt_prompts
    from specdec.serving.runtime import build_drafters, encode_prompt

    cfg = EngineConfig(max_batch_size=4, max_seq_len=1024, max_num_draft_tokens=8)
    spec = {"eagle3": SpeculativeConfig(method="eagle3", max_draft_len=5)}
    engine = SpecEngine(smol_model, cfg, tokenizer=smol_tokenizer,
                        drafters=build_drafters(smol_model.cfg, spec, cfg, embed=smol_model.embed))
    ps = [encode_prompt(smol_tokenizer, p) for p in sharegpt_prompts(16, tokenizer=smol_tokenizer, max_tokens=256)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = run_all(engine, ps, params, "none", 0, concurrent=4)
    assert run_all(engine, ps, params, "eagle3", 5, concurrent=4) == plain
    accepted = engine.stats.accepted_per_position
    assert len(accepted) == 5 and all(n > 0 for n in accepted), accepted


@pytest.mark.slow  # chi-square, as above: tests/engine/test_exact_lossless.py proves eagle3-hybrid exactly in make test
@pytest.mark.parametrize("variant", ["shipped", "dynamic_tree", "sampled_tree"])
def test_hybrid_sampling_is_lossless(toy_eagle, monkeypatch, variant):
    """The real eagle3-hybrid drafter (Eagle3Drafter with hybrid_ngram and the planner), not
    tests/support/toy.py's BigramDrafter copy, drafting for a toy target (the shipped head's
    576-wide taps and 49k vocabulary cannot pair with a 12-token target, so a head in the
    published layout sized for it stands in). "shipped": model_repository/specdec.json's
    eagle3-hybrid settings as they are; sampled requests draft the head's sampled chains
    with draft probabilities, and the n-gram continuation joins them as one-hot draws
    (DraftTree._merged_sampled). "dynamic_tree": the same with EAGLE-2 trees, deterministic
    under sampling, the continuations verified by the one-hot rule. "sampled_tree": trees
    drawn from q (sampled_tree) with the continuation joined as one-hot draws. All must merge."""
    from specdec.serving.runtime import served_methods
    from specdec.engine.tree import DraftTree

    target, head = toy_eagle
    spec = served_methods()["eagle3-hybrid"]
    assert spec.hybrid_ngram and spec.adaptive
    if variant == "dynamic_tree":
        spec = spec.replace(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2, max_total_draft_tokens=6)
    if variant == "sampled_tree":
        spec = spec.replace(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2, max_total_draft_tokens=6,
                            sampled_tree=True, sampled_tree_mass=1.0)
    merges = []  # nodes each merge added
    merge = DraftTree.merged

    def counted(tree, *args, **kwargs):
        out = merge(tree, *args, **kwargs)
        merges.append(len(out) - len(tree))
        return out

    monkeypatch.setattr(DraftTree, "merged", counted)
    drafter = _CountingEagle3(head, spec, 500, 32)
    counts = sample_first3(target, drafter, PARAMS, seed0=3000)
    p = chi_square_p(counts, exact_first3(target, PARAMS))
    assert p > 1e-3, f"{variant}: chi-square p={p:.2e}"
    assert sum(merges) > 0, "no n-gram continuation joined a tree"
