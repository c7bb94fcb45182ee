"""A control the docs claim is a test that runs (issue 61, issue 76). A sentence in the README,
docs/, a model card, a test's docstring or a comment in tests/ that claims a negative control (a
check that fails without its subject: "the same tree without the window fails", "the exact test
catches the old merge", "the mutant is killed") must name the test that asserts it, and that test
must exist in tests/ and run in `make test` (not marked slow, unless the sentence says it runs in
`make test-all`), or be the test the docstring or comment belongs to (inside it, or the comment
just above it), or cite the mutation record, which names each mutant's killing tests and is
checked by tests/project/test_mutants.py (test_the_check_finds_a_claim_with_no_test_beside_it).
An unnamed claim is how a control's sentence outlives the control."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "models").glob("*/README.md"))]
# docs/results-history.md keeps old runs' words as they were; its claims are history, not checks
HISTORY = {ROOT / "docs" / "results-history.md"}

# A claim that a check fails without (or with) something: a negative control
# (test_the_check_finds_a_claim_with_no_test_beside_it).
CLAIM = re.compile(
    r"negative control"
    r"|\bcontrol\b[^.;]*\bfail(s|ed)?\b"
    r"|\bfail(s|ed)?\b[^.;]*\b(without|left out|with SDPA|with PyTorch)\b"
    r"|\b(without|left out)\b[^.;]*\bfail(s|ed)?\b"
    r"|\bfail(s|ed)? (there|them|on it)\b"
    r"|\bfailing\b[^.;]*\b(without|control|mutant|mutated)\b"
    r"|\b(catch(es)?|caught)\b[^.;]*\b(bug|mutant|mistake|merge|regression|when)\b"
    r"|\bmutants?\b[^.;]*\bkill(s|ed)?\b|\bkill(s|ed)?\b[^.;]*\bmutants?\b"
    r"|\bdiffers?\b[^.;]*\b(without|under the control|with SDPA|with PyTorch)\b", re.I)
# A claim backed by the mutation record (results/mutants.json names each mutant's killing tests).
MUTATION_RECORD = re.compile(r"make mutants|mutants\.json|tests/support/mutants|table:mutants")
TEST_NAME = re.compile(r"\b(test_\w+)\b(?!\.py)")


def claims(text: str) -> Iterator[str]:
    """The sentences of a text that claim a control, each on one line."""
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", flat):
            if CLAIM.search(sentence):
                yield sentence


def is_slow(node: ast.FunctionDef) -> bool:
    return any("slow" in ast.unparse(d) or "gemma" in ast.unparse(d) for d in node.decorator_list)


def test_functions() -> dict[str, bool]:
    """Every test function's name in tests/ -> whether `make test` runs it (not marked slow)."""
    found: dict[str, bool] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        module_slow = any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
                          and ("slow" in ast.unparse(node.value) or "gemma" in ast.unparse(node.value)) for node in tree.body)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                found[node.name] = found.get(node.name, False) or not (module_slow or is_slow(node))
    return found


def unbacked(sentences: Iterator[str], tests: dict[str, bool], own: str | None = None) -> list[str]:
    """Claims that name no test run by `make test` (own: the test whose docstring it is)."""
    problems = []
    for sentence in sentences:
        names = TEST_NAME.findall(sentence)
        if own is not None and own in tests:
            continue  # a test's own docstring describes what it asserts
        slow_said = "test-all" in sentence
        if MUTATION_RECORD.search(sentence):
            continue
        if not names:
            problems.append(f"names no test: {sentence[:160]}")
        elif not any(tests.get(name) or (slow_said and name in tests) for name in names):
            problems.append(f"names no test that make test runs ({', '.join(names)}): {sentence[:160]}")
    return problems


def docstrings(path: Path) -> Iterator[tuple[str | None, str]]:
    """(the test function it belongs to or None, the docstring) of a module and its definitions."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            name = getattr(node, "name", None)
            if doc:
                yield (name if name and name.startswith("test_") else None), doc


def comments(path: Path) -> Iterator[tuple[str | None, str]]:
    """(the test function a comment belongs to or None, the comment) of a module: runs of
    comment lines joined; a comment belongs to the test it sits in or the one defined just below it."""
    source = path.read_text()
    owner: dict[int, str] = {}  # line -> the test function whose lines (decorators and the lines above included) hold it
    starts = []  # (first line, name) of each test
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            starts.append((first, node.name))
            for line in range(first - 3, node.end_lineno + 1):
                owner.setdefault(line, node.name)
    starts.sort()
    block, start = [], 0
    for number, line in enumerate(source.splitlines() + [""], 1):
        tokens = line.split("  # ", 1) if not line.lstrip().startswith("#") else ["", line.lstrip()[1:]]
        if len(tokens) == 2 and tokens[1].strip():
            if not block:
                start = number
            block.append(tokens[1].strip().removeprefix("#").strip())
            continue
        if block:
            text = " ".join(block)
            if text.startswith("---"):  # a section's header: the section's tests below it
                yield next((name for first, name in starts if first > start), None), text
            else:
                yield owner.get(start) or owner.get(number - 1), text
            block = []


def test_every_claimed_control_in_the_docs_names_a_test_that_runs():
    tests = test_functions()
    problems = [f"{doc.relative_to(ROOT)}: {p}" for doc in DOCS if doc not in HISTORY
                for p in unbacked(claims(doc.read_text()), tests)]
    assert problems == []


def test_every_claimed_control_in_a_test_docstring_names_a_test_that_runs():
    tests = test_functions()
    problems = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for own, doc in docstrings(path):
            problems += [f"{path.relative_to(ROOT)}: {p}" for p in unbacked(claims(doc), tests, own)]
    assert problems == []


def test_every_claimed_control_in_a_test_comment_names_a_test_that_runs():
    tests = test_functions()
    problems = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for own, comment in comments(path):
            problems += [f"{path.relative_to(ROOT)}: {p}" for p in unbacked(claims(comment), tests, own)]
    assert problems == []


def test_the_check_finds_a_claim_with_no_test_beside_it():
    """The checker's own control: claims without a runnable test are reported, in each form."""
    tests = {"test_real_control": True, "test_slow_control": False}
    for claim in ("The same tree without the window fails.", "Run with SDPA, they fail there: their negative control.",
                  "With the window left out of the reference it fails.", "A control that leaves q unmasked fails."):
        assert list(claims(claim)) == [claim]
        assert unbacked(iter([claim]), tests), claim
        assert unbacked(iter([claim + " (test_slow_control)"]), tests), claim  # slow: not in make test
        assert unbacked(iter([claim + " (test_slow_control, in make test-all)"]), tests) == []  # said so
        assert unbacked(iter([claim + " (test_missing_control, in make test-all)"]), tests)
        assert unbacked(iter([claim + " (test_real_control)"]), tests) == []
        assert unbacked(iter([claim]), tests, own="test_real_control") == []  # the test's own docstring
    assert list(claims("Admission control: a request waits. The request failed with a timeout.")) == []
    # the other phrasings of a control (issue 76), and the mutation record as their backing
    for claim in ("The exact test catches the old merge every time.", "Three mutants of the plan are killed by it.",
                  "It kills the mutant that drops the mask.", "A check failing without its window.",
                  "The output differs without the mask."):
        assert list(claims(claim)) == [claim]
        assert unbacked(iter([claim]), tests), claim
        assert unbacked(iter([claim + " (test_real_control)"]), tests) == []
        assert unbacked(iter([claim + " (results/mutants.json)"]), tests) == []
    assert list(claims("The stub differs in its name. The test kills the stub process.")) == []


def test_a_comment_belongs_to_the_test_it_sits_in_or_above(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("# a module comment\n\n\n\n\ndef helper():\n    pass  # in a helper\n\n\n"
                      "# just above\n@mark\ndef test_one():\n    x = 1  # inside\n\n\n\n\n"
                      "# ---- controls ----\n\n\n\n\ndef test_two():\n    pass\n")
    assert list(comments(module)) == [(None, "a module comment"), (None, "in a helper"), ("test_one", "just above"),
                                      ("test_one", "inside"), ("test_two", "---- controls ----")]
