"""The mutant list behind `make mutants` stays runnable (specdec/tools/mutants.py): it parses,
every `old` snippet occurs exactly once in today's code (a mutant that no longer applies is
an error there, not a survivor), every Python mutant still compiles, and the tests it names are
files `make test` runs. The record (results/mutants.json) holds a result for every mutant as
listed today, none of them stale (each ran on today's version of its file and of what its tests
load), and reaches the score the README claims. Also the runner's verdicts on a run's
exit status."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.tools.mutants import (DEFAULT_LIST, DEFAULT_OUT, ERROR, KILLED, NOT_RUN, REPO_ROOT, SURVIVED, TIMEOUT, MutantListError,
                                   PytestRun, Result, baseline_error, classify, load_mutants, mutated, record_status, summary)

MUTANTS = load_mutants(DEFAULT_LIST)
RECORD = REPO_ROOT / DEFAULT_OUT


def test_the_list_is_at_least_80_mutants_where_bugs_hurt_most():
    assert len(MUTANTS) >= 80
    areas = {
        "the engine": "specdec/engine/", "serving": "specdec/serving/", "the C kernels": "specdec/engine/kernels/",
        "the OpenAI front end": "specdec_openai/", "the Triton models": "specdec/triton_models/",
    }
    for area, prefix in areas.items():
        assert any(m.file.startswith(prefix) for m in MUTANTS), f"no mutant of {area} ({prefix})"
    assert any(m.file.endswith(".c") for m in MUTANTS), "no mutant of a C kernel"
    for subject in ("format", "guide", "tool"):
        assert any(subject in m.id for m in MUTANTS), f"no mutant whose id names {subject!r}"


def test_the_record_holds_a_fresh_result_for_every_listed_mutant_and_the_score_the_readme_claims():
    record = json.loads(RECORD.read_text())
    status = record_status(record, MUTANTS)
    assert not status.missing, (f"results/mutants.json has no result for {status.missing} as listed today: "
                                "run `make mutants`")
    assert not status.unlisted, f"results/mutants.json holds mutants no longer listed: {status.unlisted}"
    # the record describes this tree: no result ran on another version of its mutated file or
    # of what its tests load (the test files, their conftest.py, tests/support, a C mutant's headers)
    assert not status.stale, (f"results/mutants.json is stale for {len(status.stale)} mutants ({', '.join(status.stale[:8])}"
                              f"{', ...' if len(status.stale) > 8 else ''}): run `python -m specdec.tools.mutants --stale "
                              "results/mutants.json`")
    totals = record["totals"]
    assert totals == summary([Result(**r) for r in record["mutants"]])  # the totals are the results'
    assert totals["errors"] == [] and totals["score"] >= 0.95 and totals["mutants"] >= 80


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_each_mutant_applies_exactly_once_and_compiles(mutant):
    source = (REPO_ROOT / mutant.file).read_text()
    changed = mutated(mutant, source)
    assert changed != source
    if mutant.file.endswith(".py"):  # a C mutant's build is checked by `make mutants` (an error if it fails)
        compile(changed, mutant.file, "exec")
    for test in mutant.tests:
        path = REPO_ROOT / test.split("::")[0]
        assert path.is_file() and path.name.startswith("test_"), f"{mutant.id}: no test file {path}"


def test_a_snippet_that_no_longer_applies_is_an_error_naming_the_mutant():
    mutant = MUTANTS[0]
    with pytest.raises(MutantListError, match=f"{mutant.id}: field 'old' occurs 0 times"):
        mutated(mutant, "")
    with pytest.raises(MutantListError, match="occurs 2 times"):
        mutated(mutant, mutant.old + mutant.old)


def test_a_malformed_list_names_the_field(tmp_path: Path):
    entry = "[[mutant]]\nid = 'x'\nfile = 'f.py'\nold = 'a'\nnew = 'b'\ndescription = 'd'\ntests = ['tests/test_x.py']\n"
    for extra, field in (("colour = 'red'\n", "colour"), ("", "'id' is used twice")):
        path = tmp_path / "list.toml"
        path.write_text(entry + extra + (entry if not extra else ""))
        with pytest.raises(MutantListError, match=field):
            load_mutants(path)
    path.write_text(entry.replace("new = 'b'", "new = 'a'"))
    with pytest.raises(MutantListError, match="'new' equals 'old'"):
        load_mutants(path)


def test_verdicts():
    passed = PytestRun(0, 10.0, "")
    assert classify(passed, PytestRun(1, 3.0, "FAILED tests/test_a.py::t - x"), 60)[0] == KILLED
    # a mutant that breaks an import kills nothing: it is an error, whatever the tests would have seen
    assert classify(passed, PytestRun(2, 3.0, "ERROR tests/test_a.py - ImportError"), 60)[0] == ERROR
    assert classify(passed, PytestRun(0, 10.0, ""), 60)[0] == SURVIVED
    assert classify(passed, PytestRun(None, 60.0, ""), 60)[0] == TIMEOUT  # hung: counted as killed
    assert classify(passed, PytestRun(5, 1.0, ""), 60)[0] == ERROR  # its tests select nothing
    # a fixture's error (a server that never came up) is no kill: only a FAILED test is
    fixture = "ERROR tests/server/test_a.py::t - TimeoutError: not ready"
    assert classify(passed, PytestRun(1, 300.0, fixture), 600)[0] == ERROR
    assert classify(passed, PytestRun(1, 300.0, fixture + "\nFAILED tests/server/test_a.py::u - x"), 600)[0] == KILLED
    # a hang counts only when the unmutated run took less than half the limit
    assert classify(PytestRun(0, 40.0, ""), PytestRun(None, 60.0, ""), 60)[0] == ERROR
    assert baseline_error(passed) is None
    assert "fail unmutated: FAILED tests/test_a.py::t" in baseline_error(PytestRun(1, 3.0, "ERROR    log: x\nFAILED tests/test_a.py::t"))
    results = [Result(str(n), "f", "d", [], outcome, 1.0, "", "", "")
               for n, outcome in enumerate([KILLED, TIMEOUT, SURVIVED, ERROR, NOT_RUN])]
    totals = summary(results)
    assert totals["score"] == round(2 / 3, 4) and totals["survivors"] == ["2"] and totals["errors"] == ["3"]
    assert totals[NOT_RUN] == 1  # an ISA this CPU lacks: neither killed nor in the score


def test_the_record_shows_a_changed_file_and_a_changed_definition(tmp_path: Path):
    """record_status: what the README renders as a stale record, and what the record test fails on."""
    source = tmp_path / "m.py"
    source.write_text("x = 1\n")
    listed = tmp_path / "list.toml"
    listed.write_text("[[mutant]]\nid = 'a'\nfile = 'm.py'\nold = '1'\nnew = '2'\ndescription = 'd'\ntests = ['t']\n")
    mutant, = load_mutants(listed)
    from specdec.tools.mutants import file_digest
    record = {"mutants": [{"id": "a", "file": "m.py", "digest": mutant.digest(), "file_sha256": file_digest(source)},
                          {"id": "gone", "file": "m.py", "digest": "", "file_sha256": file_digest(source)}]}
    status = record_status(record, [mutant], repo=tmp_path)
    assert (status.missing, status.unlisted, status.changed_files) == ([], ["gone"], [])
    source.write_text("x = 1  # edited\n")
    assert record_status(record, [mutant], repo=tmp_path).changed_files == ["m.py"]
    listed.write_text(listed.read_text().replace("new = '2'", "new = '3'"))
    assert record_status(record, load_mutants(listed), repo=tmp_path).missing == ["a"]


def test_an_older_result_of_a_file_is_stale_beside_a_newer_one(tmp_path: Path):
    """Two mutants of one file, one rerun since the file changed: the other's result still ran
    on the old file, so the file counts as changed and that result as stale (a hash per file,
    the last result's, hid it)."""
    from specdec.tools.mutants import file_digest, tests_digest

    source = tmp_path / "m.py"
    source.write_text("x = 1\ny = 1\n")
    listed = tmp_path / "list.toml"
    listed.write_text("".join(f"[[mutant]]\nid = '{name}'\nfile = 'm.py'\nold = '{name} = 1'\nnew = '{name} = 2'\n"
                              f"description = 'd'\ntests = ['t']\n" for name in "xy"))
    x, y = load_mutants(listed)
    old = file_digest(source)
    source.write_text("x = 1\ny = 1  # edited\n")
    record = {"mutants": [{"id": m.id, "file": "m.py", "digest": m.digest(), "tests_sha256": tests_digest(m, tmp_path),
                           "file_sha256": digest} for m, digest in ((x, old), (y, file_digest(source)))]}
    status = record_status(record, [x, y], repo=tmp_path)
    assert (status.changed_files, status.stale) == (["m.py"], ["x"])


def test_a_result_goes_stale_when_its_tests_or_their_support_change(tmp_path: Path):
    """The record's hash covers what a mutant's tests load, not only the mutated file: a test it
    names, a conftest.py above it or tests/support changed since its result makes it stale."""
    from specdec.tools.mutants import file_digest, tests_digest

    (tmp_path / "tests" / "engine").mkdir(parents=True)
    (tmp_path / "tests" / "support").mkdir()
    source, test = tmp_path / "m.py", tmp_path / "tests" / "engine" / "test_m.py"
    source.write_text("x = 1\n")
    test.write_text("def test_m(): assert True\n")
    (tmp_path / "tests" / "conftest.py").write_text("# shared fixtures\n")
    (tmp_path / "tests" / "support" / "helper.py").write_text("h = 1\n")
    listed = tmp_path / "list.toml"
    listed.write_text("[[mutant]]\nid = 'a'\nfile = 'm.py'\nold = '1'\nnew = '2'\ndescription = 'd'\n"
                      "tests = ['tests/engine/test_m.py::test_m']\n")
    mutant, = load_mutants(listed)
    record = {"mutants": [{"id": "a", "file": "m.py", "digest": mutant.digest(), "file_sha256": file_digest(source),
                           "tests_sha256": tests_digest(mutant, tmp_path)}]}
    assert record_status(record, [mutant], repo=tmp_path).stale == []
    for changed in (test, tmp_path / "tests" / "conftest.py", tmp_path / "tests" / "support" / "helper.py"):
        saved = changed.read_text()
        changed.write_text(saved + "# edited\n")
        assert record_status(record, [mutant], repo=tmp_path).stale == ["a"], changed
        changed.write_text(saved)
    source.write_text("x = 1  # edited\n")
    assert record_status(record, [mutant], repo=tmp_path).stale == ["a"]
    del record["mutants"][0]["tests_sha256"]  # a result from before the tests were hashed
    source.write_text("x = 1\n")
    assert record_status(record, [mutant], repo=tmp_path).stale == ["a"]


def test_an_update_replaces_only_its_mutants_and_recomputes_the_totals(tmp_path: Path):
    from specdec.tools.mutants import update_report

    listed = [MUTANTS[0], MUTANTS[1]]
    old = [Result(m.id, m.file, m.description, [], outcome, 1.0, "", m.digest(), "")
           for m, outcome in zip(listed, [KILLED, SURVIVED])]
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"commit": "abc", "mutants": [r.__dict__ for r in old], "totals": summary(old)}))
    rerun = Result(listed[1].id, listed[1].file, listed[1].description, [], KILLED, 2.0, "", listed[1].digest(), "")
    report = update_report(path, "cmd", [rerun], 2.0, {"commit": "def", "clean": True, "uncommitted": []}, listed)
    assert [r["outcome"] for r in report["mutants"]] == [KILLED, KILLED]
    assert report["totals"]["score"] == 1.0 and report["commit"] == "abc"  # the record keeps its own tree
    assert report["updates"][0]["mutants"] == [listed[1].id] and json.loads(path.read_text()) == report


def test_what_a_run_leaves_running_from_its_copy_is_stopped(tmp_path: Path):
    """A server a mutant's fixture never stopped (its own session, out of the run's killpg) is
    killed after the run; a process outside the copy is left alone."""
    import subprocess
    import sys

    from specdec.tools.mutants import stop_left_behind

    copy, other = tmp_path / "worker1", tmp_path / "worker10"  # a prefix of another copy's path is not inside it
    copy.mkdir(), other.mkdir()
    script = "import time; time.sleep(60)"
    left = subprocess.Popen([sys.executable, "-c", script, str(copy / "model_repository")], start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", script, str(other / "model_repository")], start_new_session=True)
    try:
        assert stop_left_behind(copy) == [left.pid]
        assert left.wait(10) != 0 and bystander.poll() is None
    finally:
        bystander.kill()
        left.kill()
