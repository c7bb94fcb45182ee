"""The README's numbers describe files under results/, not memory: every results table is
rendered from its source (`specdec readme-tables`), each source records the commit it
measured, the date and the machine, no measured figure stands outside a rendered table, and
every link resolves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.tools import readme_tables

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# A measured figure: a decimal (not a three-part version), a ratio, a percentage, "N of M",
# or a number with a unit of time or throughput.
FIGURE = re.compile(
    r"(?<![\w.])\d+\.\d+(?!\.\d)x?(?![\w.])"
    r"|\b\d+(\.\d+)?\s?%"
    r"|\b\d[\d,]* of \d[\d,]*\b"
    r"|\b\d[\d,.]*\s?(ms|tok/s|s)\b"
)


def prose_outside_tables(text: str) -> str:
    """What a person wrote: the README without code blocks, inline code, link targets,
    HTML comments and the rendered tables."""
    text = readme_tables.BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def unsourced_figures(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(prose_outside_tables(text))]


def test_readme_tables_are_rendered_from_their_sources():
    names = []
    for document in readme_tables.DOCUMENTS:
        text = document.read_text()
        names += [m["name"] for m in readme_tables.BLOCK.finditer(text)]
        rendered, unknown = readme_tables.rewrite(text, document)
        assert not unknown
        assert rendered == text, f"a table in {document.name} differs from its source: run `specdec readme-tables`"
    assert sorted(names) == sorted(readme_tables.TABLES), "every renderer has its table in one document, and no other"


def unmarked_tables(text: str) -> list[str]:
    """The header of each table outside a rendered block not marked `<!-- hand-written: why -->`
    on the line above, past the page's first (its index of sections and sources)."""
    lines = readme_tables.BLOCK.sub("", text).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]
    assert starts and re.fullmatch(r"\| section \| source \|", lines[starts[0]])
    return [lines[i][:80] for i in starts[1:] if not re.fullmatch(r"<!-- hand-written: .+ -->", lines[i - 1])]


def test_every_table_in_the_results_doc_is_rendered_or_marked_hand_written():
    """A new table in docs/results.md is rendered from its results file, or says why not."""
    text = readme_tables.RESULTS_DOC.read_text()
    assert unmarked_tables(text) == [], "tables in docs/results.md neither rendered nor marked hand-written"
    # the check sees a table typed in unmarked, and passes it once marked
    typed = "\n| mode | tok/s |\n|---|---|\n| eagle3 | 12.3 |\n"
    assert unmarked_tables(text + typed) == ["| mode | tok/s |"]
    assert unmarked_tables(text + "\n<!-- hand-written: why -->" + typed) == []


def test_every_results_path_the_results_doc_cites_exists_and_shows_what_it_recorded(tmp_path, monkeypatch):
    text = readme_tables.BLOCK.sub("", readme_tables.RESULTS_DOC.read_text())
    cited = sorted(set(readme_tables.CITED.findall(text)))
    assert len(cited) > 20 and [c for c in cited if not (ROOT / c).exists()] == []
    # a file that records no commit shows unknown, never the commit that added it
    monkeypatch.setattr(readme_tables, "ROOT", tmp_path)
    (tmp_path / "old.json").write_text('{"tok_s": 1.0}')
    (tmp_path / "new.json").write_text('{"commit": "0123456789abcdef", "clean": true, "date": "2026-12-07", "machine": "m"}')
    assert readme_tables.recorded_or_unknown("old.json") == ("unknown", "unknown", "unknown")
    assert readme_tables.recorded_or_unknown("new.json") == ("0123456", "2026-12-07", "m")


def test_a_hand_edited_table_figure_is_caught():
    text = README.read_text()
    block = next(readme_tables.BLOCK.finditer(text))
    body = block["body"]
    edited_body = re.sub(r"\d+\.\d+", lambda m: f"{float(m.group(0)) + 0.1:.2f}", body, count=1)
    assert edited_body != body
    edited = text.replace(body, edited_body, 1)
    assert readme_tables.rewrite(edited)[0] != edited


def test_no_measured_figure_outside_a_rendered_table():
    assert unsourced_figures(README.read_text()) == []
    # the check sees a figure written by hand into the prose, in every form it looks for
    for figure in ("1.64x", "133 ms", "12.4 tok/s", "180 of 180", "48%", "0.29"):
        assert unsourced_figures(f"speculation gave {figure} here"), figure
    assert unsourced_figures("Arctic Inference 0.3.0, 64 tokens at c=16 on 2 cores") == []  # settings, not figures


README_TABLES = sorted(m["name"] for m in readme_tables.BLOCK.finditer(README.read_text()))


@pytest.mark.parametrize("name", README_TABLES)
def test_every_source_records_commit_date_and_machine(name):
    """The README's tables: each source records its provenance (docs/results.md's may show
    unknown, as its table of cited files does)."""
    for path in readme_tables.TABLES[name]().sources:
        commit, date, machine = readme_tables.provenance(path)
        assert re.fullmatch(r"[0-9a-f]{7}( with local changes| \(tree state unknown\))?", commit), (path, commit)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date) and machine, path


def github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", path.read_text(), flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}
            if anchor not in anchors:
                broken.append(target)
    assert broken == [], f"{doc}: links that do not resolve"


def test_new_results_record_the_commit_they_measured():
    """What every result writer stores (benchmark summaries, bench-engine/-load/-serving,
    greedy-margin): this checkout's commit, "+dirty" when tracked code differs from it."""
    from specdec_client.envinfo import environment, git_commit

    commit = git_commit(ROOT)
    if commit is None:
        pytest.skip("not a git checkout")
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit)
    env = environment(None, None)
    assert env["commit"] == git_commit() and env["date"] and env["host"]["cpu_model"]
