"""The mutant list behind `make mutants` stays runnable (specdec/tools/mutants.py): it parses,
every `old` snippet occurs exactly once in today's code (a mutant that no longer applies is
an error there, not a survivor), every mutant still compiles, and the tests it names are
files `make test` runs. Also the runner's verdicts on a run's exit status."""
from __future__ import annotations

from pathlib import Path

import pytest

from specdec.tools.mutants import (DEFAULT_LIST, ERROR, KILLED, REPO_ROOT, SURVIVED, TIMEOUT, MutantListError, PytestRun,
                                   baseline_error, classify, load_mutants, mutated, summary, Result)

MUTANTS = load_mutants(DEFAULT_LIST)


def test_the_list_is_at_least_25_mutants_over_the_engine_and_serving_code():
    assert len(MUTANTS) >= 25
    assert {m.file.split("/")[1] for m in MUTANTS} == {"engine", "serving"}


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_each_mutant_applies_exactly_once_and_compiles(mutant):
    source = (REPO_ROOT / mutant.file).read_text()
    changed = mutated(mutant, source)
    assert changed != source
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
    assert classify(passed, PytestRun(2, 3.0, "ERROR tests/test_a.py - ImportError"), 60)[0] == KILLED  # broke an import
    assert classify(passed, PytestRun(0, 10.0, ""), 60)[0] == SURVIVED
    assert classify(passed, PytestRun(None, 60.0, ""), 60)[0] == TIMEOUT  # hung: counted as killed
    assert classify(passed, PytestRun(5, 1.0, ""), 60)[0] == ERROR  # its tests select nothing
    assert baseline_error(passed) is None
    assert "fail unmutated: FAILED tests/test_a.py::t" in baseline_error(PytestRun(1, 3.0, "ERROR    log: x\nFAILED tests/test_a.py::t"))
    results = [Result(str(n), "f", "d", [], outcome, 1.0, "") for n, outcome in enumerate([KILLED, TIMEOUT, SURVIVED, ERROR])]
    totals = summary(results)
    assert totals["score"] == round(2 / 3, 4) and totals["survivors"] == ["2"] and totals["errors"] == ["3"]
