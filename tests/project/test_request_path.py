"""A request is validated in one place: each of its checks (the prompt's, the sampling
settings', the token-level rules', the method's) has exactly one call site in the product,
inside validate_request, and validate_request is called by the entry points only (the
request parser every Triton and TensorRT-LLM model reads through, and the in-process
engine's prepare_request). The verifier behind the loop calls none of them: it trusts what
the loop validated (docs/serving.md#one-request-one-record)."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("specdec", "trtllm_repository", "model_repository", "specdec_openai", "client")
CHECKS = ("check_prompt_ids", "resolve_token_rules", "resolve_method")
# SamplingParams.validate is the only `validate` method the product calls on its own records
# (jsonschema.validate is a module function: `jsonschema.validate(...)`, not counted).
SAMPLING_VALIDATE = "validate"


class _Calls(ast.NodeVisitor):
    """Calls to the checks, each under its innermost enclosing function."""

    def __init__(self, where: str):
        self.where, self.stack, self.counts = where, ["<module>"], Counter()

    def visit_FunctionDef(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node):
        callee = node.func
        if isinstance(callee, ast.Name) and callee.id in (*CHECKS, "validate_request"):
            self.counts[(callee.id, self.where, self.stack[-1])] += 1
        elif (isinstance(callee, ast.Attribute) and callee.attr == SAMPLING_VALIDATE
              and not (isinstance(callee.value, ast.Name) and callee.value.id == "jsonschema")):
            self.counts[(SAMPLING_VALIDATE, self.where, self.stack[-1])] += 1
        self.generic_visit(node)


def call_sites(source: str, where: str = "<source>") -> Counter:
    """(check, file, innermost function) -> how many calls."""
    calls = _Calls(where)
    calls.visit(ast.parse(source))
    return calls.counts


def product_call_sites() -> Counter:
    counts: Counter = Counter()
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            counts.update(call_sites(path.read_text(), str(path.relative_to(ROOT))))
    return counts


def sites_of(counts: Counter, name: str) -> list[tuple[str, str, int]]:
    return [(file, function, n) for (called, file, function), n in counts.items() if called == name]


def test_each_check_a_request_gets_is_called_once_inside_validate_request():
    counts = product_call_sites()
    for name in (*CHECKS, SAMPLING_VALIDATE):
        assert sites_of(counts, name) == [("specdec/serving/request.py", "validate_request", 1)], name


def test_validate_request_is_called_by_the_entry_points_only():
    counts = product_call_sites()
    assert sorted(sites_of(counts, "validate_request")) == [
        ("specdec/serving/request.py", "parse_request", 1),  # the Triton loop, the CLI, the TensorRT-LLM variant
        ("specdec/serving/spec_engine.py", "prepare_request", 1),  # the in-process engine
    ]


def test_the_count_sees_a_second_call_site():
    """Negative control: a check called again elsewhere (the verifier re-validating, say) is counted."""
    source = (
        "def validate_request(p):\n    check_prompt_ids(p)\n    p.validate(1)\n"
        "def submit(p):\n    check_prompt_ids(p)\n    def inner():\n        params.validate(2)\n"
    )
    counts = call_sites(source)
    assert len(sites_of(counts, "check_prompt_ids")) == 2
    assert sorted(f for _, f, _ in sites_of(counts, SAMPLING_VALIDATE)) == ["inner", "validate_request"]
