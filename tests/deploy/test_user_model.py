"""`specdec serve --model DIR --eagle3-head DIR ...`: a team's own model and heads served with
no hand-written JSON. The method table comes from what is given (the head's depth from its
speculators config), a head that does not fit the target is refused naming the key, and the
generated settings serve through the real Triton server with greedy speculation equal to the
baseline."""
from __future__ import annotations

import json
import shutil

import pytest

from specdec.config import ServingConfig
from specdec.engine.drafters.eagle3 import DEFAULT_HEAD
from specdec.engine.drafters.medusa import DEFAULT_HEADS
from specdec.engine.models.eagle3_head import export_speculators
from specdec.errors import ConfigError
from specdec.tools import user_model


@pytest.fixture(scope="module")
def speculators_head(tmp_path_factory):
    return export_speculators(DEFAULT_HEAD, tmp_path_factory.mktemp("head") / "speculators", "SmolLM2-135M-Instruct")


def test_the_method_table_follows_what_is_given(smol_dir, speculators_head, tmp_path):
    plain = user_model.user_settings(smol_dir)
    assert set(plain["methods"]) == {"ngram", "suffix"} and plain["default_method"] == "ngram"
    full = user_model.user_settings(smol_dir, eagle3_head=speculators_head, medusa_heads=DEFAULT_HEADS)
    assert set(full["methods"]) == {"ngram", "suffix", "medusa", "eagle3", "eagle3-tree"} and full["default_method"] == "eagle3"
    assert full["methods"]["eagle3"]["max_draft_len"] == 3  # the speculators config's speculative_tokens
    assert full["methods"]["eagle3-tree"]["use_dynamic_tree"] and full["model_dir"] == str(smol_dir.resolve())
    path = tmp_path / "s.json"
    path.write_text(json.dumps(full))
    assert ServingConfig.from_file(path).default_method == "eagle3"  # what the server reads


def test_a_head_for_another_target_is_refused_naming_the_key(smol_dir, speculators_head, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(speculators_head, head)
    config = json.loads((head / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 14, 40]
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        user_model.user_settings(smol_dir, eagle3_head=head)
    assert err.value.field == "eagle_aux_hidden_state_layer_ids"
    assert user_model.serve_main(["--eagle3-head", str(head)]) == 2  # a head without --model


def test_serve_hands_the_generated_settings_to_the_server(smol_dir, speculators_head, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(user_model, "launcher_serve_main", lambda rest: seen.update(rest=rest, env=user_model.os.environ["SPECDEC_SETTINGS"]) or 0)
    # serve_main sets SPECDEC_SETTINGS for the server it starts: undone after the test (a
    # leaked value once made a later fixture's server read these settings)
    monkeypatch.setenv("SPECDEC_SETTINGS", "restored-after-the-test")
    monkeypatch.delenv("SPECDEC_SETTINGS")
    out = tmp_path / "settings.json"
    assert user_model.serve_main(["--model", str(smol_dir), "--eagle3-head", str(speculators_head), "--settings-out", str(out),
                                  "--http-port", "18000"]) == 0
    assert seen["rest"] == ["--http-port", "18000"] and seen["env"] == str(out.resolve())
    assert json.loads(out.read_text())["default_method"] == "eagle3"


@pytest.mark.server
def test_the_users_model_and_head_serve_through_triton(smol_dir, speculators_head, tmp_path):
    """The generated settings through the real server: the exported head drafts (accepted
    tokens) and greedy output equals the baseline's, token for token."""
    from specdec.launcher.local import local_server
    from specdec_client import GenerateRequest, SpecDecClient

    path = tmp_path / "settings.json"
    settings = user_model.user_settings(smol_dir, eagle3_head=speculators_head)
    settings["engine"].update(max_seq_len=512, max_tokens_limit=256)
    path.write_text(json.dumps(settings))
    accepted = 0
    with local_server(tmp_path / "triton.log", path) as endpoints, SpecDecClient(endpoints.grpc, protocol="grpc") as client:
        for prompt in ("Write a haiku about the sea.", "List three prime numbers and say why they are prime."):
            plain = client.generate(GenerateRequest(prompt, max_tokens=32, num_draft_tokens=0, ignore_eos=True))
            for method in ("eagle3", "eagle3-tree"):
                spec = client.generate(GenerateRequest(prompt, max_tokens=32, method=method, ignore_eos=True))
                assert spec.text == plain.text, method
                accepted += spec.perf.get("total_accepted_draft_tokens", 0)
    assert accepted > 0  # the user's head drafted, and its drafts were kept


def test_a_gguf_file_is_served_as_its_prepared_directory(smol_dir):
    """--model FILE.gguf: converted once into the cache (the embedded target's own file maps
    to its one prepared copy), then the same method table as for a directory."""
    from specdec.engine.models.loading import default_gguf_path

    settings = user_model.user_settings(default_gguf_path())
    assert settings["model_dir"] == str(smol_dir.resolve()) and set(settings["methods"]) == {"ngram", "suffix"}


def test_the_gemma_name_needs_its_download_and_settings_only_serves_nothing(smol_dir, tmp_path, monkeypatch):
    """--model gemma3-270m is the opt-in target by name (refused, saying how to prepare it,
    when it is not); --settings-only writes the settings for a benchmark and starts no server."""
    monkeypatch.setattr(user_model, "gemma_model_dir", lambda: tmp_path / "not-prepared")
    with pytest.raises(ConfigError, match="make prepare-gemma") as err:
        user_model.user_settings("gemma3-270m")
    assert err.value.field == "--model"
    monkeypatch.setattr(user_model, "launcher_serve_main", lambda rest: pytest.fail("--settings-only started a server"))
    monkeypatch.setenv("SPECDEC_SETTINGS", "restored-after-the-test")
    out = tmp_path / "settings.json"
    assert user_model.serve_main(["--model", str(smol_dir), "--settings-out", str(out), "--settings-only"]) == 0
    assert json.loads(out.read_text())["methods"].keys() == {"ngram", "suffix"}


def test_a_head_shipping_another_tokenizer_is_refused_naming_the_key(smol_dir, speculators_head, tmp_path):
    """A head (or draft) that carries a tokenizer must carry the target's: one extra token is
    refused by the key `tokenizer`, at settings time and by the check every drafter build runs;
    the target's own tokenizer beside the head is accepted."""
    from transformers import AutoTokenizer

    from specdec.engine.models.loading import check_same_tokenizer

    same, other = tmp_path / "same", tmp_path / "other"
    for head in (same, other):
        shutil.copytree(speculators_head, head)
    tokenizer = AutoTokenizer.from_pretrained(str(smol_dir))
    tokenizer.save_pretrained(str(same))
    assert "eagle3" in user_model.user_settings(smol_dir, eagle3_head=same)["methods"]
    tokenizer.add_tokens(["<not-the-targets>"])
    tokenizer.save_pretrained(str(other))
    with pytest.raises(ConfigError) as err:
        user_model.user_settings(smol_dir, eagle3_head=other)
    assert err.value.field == "tokenizer" and "<not-the-targets>" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(other, smol_dir)
    assert err.value.field == "tokenizer"
