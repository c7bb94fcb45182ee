"""Writes tasks.jsonl: the tool-call workload (issue 47), as the OpenAI front end sends it.

Each task is a chat request with `tools` (the four functions of data/structured/make_tasks.py,
with their descriptions) and a forced `tool_choice`: "required" for most, a named function for
every third; one call each (parallel_tool_calls not sent). The line holds what specdec_openai.tool_calls makes of it: the prompt rendered with the
target's chat template and the documented tool layout (`raw`: sent without the server's
template), the forced call's grammar (guide_type ebnf_grammar), and each tool's parameters
(`tool_schemas`) to validate the call the benchmark gets back. Run (needs the prepared model):
    .venv/bin/python data/tools/make_tasks.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "structured"))

from make_tasks import TOOL_CALLS, TOOLS as CALL_SCHEMAS  # noqa: E402 - the structured workload's tools and requests

from specdec.config import resolve_model_dir  # noqa: E402
from specdec.serving.runtime import load_tokenizer  # noqa: E402
from specdec_openai.frontend import render_messages  # noqa: E402
from specdec_openai.tool_calls import call_grammar, tool_plan  # noqa: E402

MAX_TOKENS = 160
DESCRIPTIONS = {"get_weather": "The current weather in a city", "book_flight": "Book a flight",
                "send_email": "Send an email", "create_reminder": "Create a reminder at a time"}
MORE_REQUESTS = [
    ("get_weather", "Should I take an umbrella in London this afternoon?"),
    ("get_weather", "How cold is it in Montreal? Celsius."),
    ("book_flight", "Two tickets from Paris to Berlin on 2025-09-12, please."),
    ("send_email", "Tell jane@example.com the report is ready."),
    ("create_reminder", "Remind me at 8am to take my medicine."),
]


def tools() -> list[dict]:
    return [{"type": "function", "function": {"name": name, "description": DESCRIPTIONS[name],
                                              "parameters": schema["properties"]["arguments"]}} for name, schema in CALL_SCHEMAS.items()]


def main() -> None:
    tokenizer = load_tokenizer(resolve_model_dir(None))
    listed = tools()
    rows = []
    for i, (name, text) in enumerate(TOOL_CALLS + MORE_REQUESTS):
        choice = {"type": "function", "function": {"name": name}} if i % 3 == 2 else "required"
        plan = tool_plan({"tools": listed, "tool_choice": choice})  # one call each
        prompt = render_messages([{"role": "user", "content": text}], tokenizer, plan)
        rows.append({"id": f"tool-call-{i:02d}", "kind": "named" if i % 3 == 2 else "required", "prompt": prompt, "raw": True,
                     "guide_type": "ebnf_grammar", "guide": call_grammar(plan), "max_tokens": MAX_TOKENS,
                     "tool_schemas": {t["name"]: t.get("parameters") or {"type": "object"} for t in plan.tools
                                      if plan.named in (None, t["name"])}})
    with open(HERE / "tasks.jsonl", "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} tasks to {HERE / 'tasks.jsonl'}")


if __name__ == "__main__":
    main()
