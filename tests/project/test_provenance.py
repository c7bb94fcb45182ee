"""Every file under results/ says where it came from (issue 61 item 7): its own record of the
commit, whether the tree was clean (explicitly, or a "+dirty" commit), the date and the
machine; or a record beside it in its folder that does (the plots, logs and request lists of
a run); or an entry of results/provenance.json, which holds what git history knows of the
files measured before every writer recorded all four (and says "clean": null, unknown).
New results are stamped by one writer, specdec_client.envinfo.write_result.

docs/results.md: every results/ path it names exists, and every section names one."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from specdec.tools import readme_tables
from specdec_client import envinfo

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "results/provenance.json"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    """The committed files under results/ (what a clone holds; a run's uncommitted output is checked once committed)."""
    try:
        files = git("ls-files", "results").split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted(f for f in files if f != MANIFEST and (ROOT / f).is_file())


def records_provenance(record) -> bool:
    """Commit, clean (explicit, or a "+dirty" commit), date and machine, at the top level or under env."""
    if not isinstance(record, dict):
        return False
    env = record.get("env") if isinstance(record.get("env"), dict) else {}
    commit = record.get("commit") or env.get("commit")
    date = record.get("date") or env.get("date")
    machine = record.get("host") or record.get("machine") or env.get("host") or env.get("cpu") or env.get("machine")
    clean = record.get("clean", env.get("clean"))
    clean_known = isinstance(clean, bool) or (isinstance(commit, str) and commit.endswith("+dirty"))
    return bool(commit and date and machine and clean_known)


def own_record(path: str) -> bool:
    if not path.endswith(".json"):
        return False
    try:
        return records_provenance(json.loads((ROOT / path).read_text()))
    except (OSError, ValueError):
        return False


def manifest_entries() -> dict[str, dict]:
    return json.loads((ROOT / MANIFEST).read_text())["entries"]


def uncovered(files: list[str], entries: dict[str, dict]) -> list[str]:
    recorded = {f for f in files if own_record(f)}
    # a run folder's record covers its plots and logs; results/ itself holds unrelated runs
    folders = {str(PurePosixPath(f).parent) for f in recorded} - {"results"}
    in_manifest = lambda f: any(f == key or (key.endswith("/") and f.startswith(key)) for key in entries)
    return [f for f in files if f not in recorded and str(PurePosixPath(f).parent) not in folders and not in_manifest(f)]


def test_every_results_file_records_or_is_covered(tracked):
    assert uncovered(tracked, manifest_entries()) == []


def test_the_check_sees_a_file_with_no_provenance(tracked):
    """Negative control: drop the manifest and the files it covers are reported, and a run
    folder's record covers its plots only while it records all four."""
    entries = manifest_entries()
    covered_by_manifest = [f for f in tracked if any(f == k or (k.endswith("/") and f.startswith(k)) for k in entries)]
    # recorded since the manifest was written: a file of its own, or a run folder's record beside it
    folders = {str(PurePosixPath(f).parent) for f in tracked if own_record(f)} - {"results"}
    manifest_only = [f for f in covered_by_manifest if not own_record(f) and str(PurePosixPath(f).parent) not in folders]
    assert manifest_only and set(manifest_only) <= set(uncovered(tracked, {}))
    assert not records_provenance({"env": {"commit": "abc", "date": "2026-12-05", "host": {"cpu_model": "x"}}})  # clean unknown
    assert records_provenance({"env": {"commit": "abc+dirty", "date": "2026-12-05", "host": {"cpu_model": "x"}}})


def first_added() -> dict[str, str]:
    """Path -> the commit that first added it there (renames count as adds at the new path)."""
    added: dict[str, str] = {}
    commit = None
    for line in git("log", "--no-renames", "--diff-filter=A", "--name-only", "--format=@%H", "--", "results").splitlines():
        if line.startswith("@"):
            commit = line[1:]
        elif line.strip():
            added[line.strip()] = commit  # newest first: the last seen is the first add
    return added


def test_manifest_entries_name_existing_paths_and_the_commits_that_added_them(tracked):
    entries = manifest_entries()
    assert entries
    added = first_added()
    commits = sorted({entry["commit"] for entry in entries.values()})
    known = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input="".join(f"{c}^{{commit}}\n" for c in commits),
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert [c for c, line in zip(commits, known) if line.endswith("missing")] == [], "not commits of this repository"
    dates = dict(line.split(" ", 1) for line in git("log", "--no-walk=unsorted", "--format=%H %aI", *commits).splitlines())
    for key, entry in entries.items():
        assert key.startswith("results/") and (ROOT / key).exists(), f"{key}: no such path"
        assert set(entry) >= {"commit", "clean", "date", "machine", "known_from"} and entry["known_from"], key
        assert entry["clean"] is None or isinstance(entry["clean"], bool), key
        assert dates[entry["commit"]] == entry["date"], f"{key}: {entry['date']} is not its commit's date"
        under = [f for f in tracked if f == key or (key.endswith("/") and f.startswith(key))]
        assert under, f"{key}: covers no committed file"
        assert entry["commit"] in {added.get(f) for f in under}, f"{key}: {entry['commit']} did not add it"


def test_the_writer_stamps_commit_clean_date_and_machine_at_the_top(tmp_path):
    path = envinfo.write_result(tmp_path / "sub" / "r.json", {"env": {"dtype": "int8"}, "tok_s": 1.0})
    record = json.loads(path.read_text())
    assert list(record)[:5] == ["commit", "clean", "date", "host", "tree"]
    assert record["env"] == {"dtype": "int8"} and record["tok_s"] == 1.0
    assert record["host"]["cpu_model"] and record["date"]
    assert "kernel_path" in record["host"] and "threads" in record["host"]
    if record["commit"] is not None:  # a git checkout
        assert isinstance(record["clean"], bool) and record["clean"] == (not record["commit"].endswith("+dirty"))
        assert record["tree"] == "clean" if record["clean"] else record["tree"].startswith("diff:")
        assert records_provenance(record)


def test_the_tree_state_names_the_diff_it_measured(tmp_path):
    """Two different local changes give two different tree states; undoing them gives clean."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    (repo / "code.py").write_text("a = 1\n")
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "x"], cwd=repo, check=True)
    assert envinfo.tree_state(repo) == "clean"
    (repo / "code.py").write_text("a = 2\n")
    first = envinfo.tree_state(repo)
    (repo / "code.py").write_text("a = 3\n")
    second = envinfo.tree_state(repo)
    assert first.startswith("diff:") and second.startswith("diff:") and first != second
    (repo / "results").mkdir()
    (repo / "code.py").write_text("a = 1\n")
    assert envinfo.tree_state(repo) == "clean"
    assert envinfo.git_commit(repo).endswith("+dirty") is False


def test_a_tree_dirty_at_the_start_or_moved_during_the_run_is_not_clean(monkeypatch):
    head = "a" * 40
    now = {"commit": head, "clean": True, "date": "2026-12-05T10:00:00+00:00", "host": {"cpu_model": "x"}}
    monkeypatch.setattr(envinfo, "provenance", lambda: dict(now))
    started_dirty = {**now, "commit": head + "+dirty", "clean": False, "date": "2026-12-05T09:00:00+00:00"}
    record = envinfo.stamped({"x": 1}, started_dirty)
    assert record["commit"] == head + "+dirty" and record["clean"] is False and record["date"].startswith("2026-12-05T09")
    record = envinfo.stamped({"x": 1}, {**now, "commit": "b" * 40})
    assert record["clean"] is False and record["commit"] == "b" * 40 and record["commit_at_write"] == head
    record = envinfo.stamped({"env": {"commit": head, "date": "2026-12-01T00:00:00"}, "x": 1})  # an env record's start
    assert record["clean"] is True and record["date"] == "2026-12-01T00:00:00" and record["env"]["commit"] == head
    now["commit"] = head + "+dirty"  # the tree changed under the run
    assert envinfo.stamped({"x": 1}, {**now, "commit": head})["clean"] is False


HOST = {"cpu_model": "AMD EPYC", "cpus_usable": 2, "cpu_count": 2}
WHEN = "2026-12-05T10:00:00+00:00"


@pytest.mark.parametrize("record, state", [
    ({"commit": "0123456789abcdef+dirty", "date": WHEN, "host": HOST}, " with local changes"),
    ({"commit": "0123456789abcdef", "clean": False, "date": WHEN, "host": HOST}, " with local changes"),
    ({"commit": "0123456789abcdef", "uncommitted": ["specdec/engine/step.py"], "date": WHEN, "host": HOST}, " with local changes"),
    ({"env": {"commit": "0123456789abcdef", "clean": False, "date": WHEN, "host": HOST}}, " with local changes"),
    ({"commit": "0123456789abcdef", "clean": True, "date": WHEN, "host": HOST}, ""),
    ({"env": {"commit": "0123456789abcdef", "clean": True, "date": WHEN, "host": HOST}}, ""),
    # not recorded (written before the writer said): unknown, never shown as clean
    ({"env": {"commit": "0123456789abcdef", "date": WHEN, "host": HOST}}, " (tree state unknown)"),
    ({"commit": "0123456789abcdef", "date": WHEN, "host": HOST}, " (tree state unknown)"),
])
def test_readme_source_lines_say_when_a_source_was_measured_with_local_changes(tmp_path, record, state):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(record))
    commit, date, machine = readme_tables.provenance(str(path))
    assert commit == "0123456" + state
    assert date == "2026-12-05" and machine == "AMD EPYC x 2"
    if "commit" in record and state == "":  # the writer's record of a run that began on a dirty tree reads the same way
        started = {"commit": record["commit"] + "+dirty", "date": WHEN, "host": HOST}
        path.write_text(json.dumps(envinfo.stamped(record, started)))
        assert readme_tables.provenance(str(path))[0] == "0123456 with local changes"


# ---- docs/results.md ---------------------------------------------------------------------
RESULTS_MD = ROOT / "docs" / "results.md"
RESULTS_PATH = re.compile(r"results/[\w.\-/]*")


def test_every_results_path_docs_results_names_exists():
    named = sorted(set(RESULTS_PATH.findall(RESULTS_MD.read_text())))
    assert named
    assert [p for p in named if not (ROOT / p.rstrip(".")).exists()] == []


def test_every_section_of_docs_results_names_its_source():
    sections = re.split(r"^(## .+)$", RESULTS_MD.read_text(), flags=re.M)[1:]
    assert sections
    unsourced = [sections[i] for i in range(0, len(sections), 2) if not RESULTS_PATH.search(sections[i] + sections[i + 1])]
    assert unsourced == []
