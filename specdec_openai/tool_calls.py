"""OpenAI's `tools` / `tool_choice` for `specdec openai`: the prompt, the grammar and the parser.

The tool-call format is Hermes's (Qwen2.5's and Qwen3's templates use it): the system turn
lists the functions' JSON signatures inside <tools></tools>, and the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A target whose own chat template takes `tools` (Qwen3) renders them itself; one whose template
has none (SmolLM2, Gemma 3) gets the documented template here (TOOLS_SYSTEM_PROMPT): the tool
list appended to the system turn, earlier calls written back as <tool_call> blocks, and tool
results as <tool_response> blocks in a user turn (Qwen's layout).

tool_choice:
- "none": no tools in the prompt; plain text out.
- "auto": tools in the prompt, the model decides; the answer is parsed (parse_tool_calls),
  text outside the blocks is the message's content.
- "required" / a named function: the answer is forced by a grammar (xgrammar: the literal
  tags around the JSON schema of {"name": <const>, "arguments": <the function's parameters>},
  a union over the tools for "required"), so the arguments always validate; the grammar's
  forced tokens are drafted without the drafter (specdec/engine/grammar.py). "required" makes
  one call; with parallel_tool_calls: true, one or more, one per line (not by default, unlike
  OpenAI's: a small model repeats its call until max_tokens cuts one in half); a named
  function is called once.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A bad tools / tool_choice value; param is the OpenAI parameter to name."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the server: the tools, and which choice."""

    tools: tuple[Mapping[str, Any], ...]  # OpenAI's function objects ({"name", "parameters", ...})
    choice: str  # "none", "auto", "required", or "function" (named)
    named: str | None = None
    parallel: bool = False  # parallel_tool_calls sent true: "required" may make several calls

    @property
    def in_prompt(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def parsed(self) -> bool:
        """Whether the answer is read for tool calls (auto, required, named)."""
        return self.in_prompt

    def parameters(self, name: str) -> Mapping[str, Any]:
        return next(t for t in self.tools if t["name"] == name).get("parameters") or {"type": "object"}


def tool_plan(body: Mapping[str, Any]) -> ToolPlan | None:
    """tools and tool_choice validated, naming the parameter; None when no tools are sent."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        parameters = function.get("parameters")
        if parameters is not None and not (isinstance(parameters, dict) and parameters.get("type", "object") == "object"):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON schema of an object")
        functions.append(function)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools", "tool names must be unique")
    parallel = body.get("parallel_tool_calls", False)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {parallel!r}")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError("tool_choice", f"tool_choice must be none, auto, required or a named function, got {choice!r}")
        return ToolPlan(tuple(functions), choice, parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if name not in names:
        raise ToolError("tool_choice", f"tool_choice names no tool in tools: {choice!r}")
    return ToolPlan(tuple(functions), "function", name, parallel=False)


def template_takes_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render_call(name: str, arguments: Any) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def with_tools(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """OpenAI messages (tool calls and tool results included) as plain chat turns in the
    documented layout, for a chat template that does not take tools."""
    out: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [render_call(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}")) for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn (Qwen's layout)
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    if plan is not None and plan.in_prompt:
        listing = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                                                              for t in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def call_grammar(plan: ToolPlan) -> str:
    """The EBNF (xgrammar's dialect) of the forced answer: a call is the tags around the JSON
    of {"name": <a tool's name>, "arguments": <its parameters' schema>} (one tool when named);
    with plan.parallel, one call or more, a newline between them."""
    import xgrammar as xgr

    names = [plan.named] if plan.choice == "function" else [t["name"] for t in plan.tools]
    calls = [xgr.Grammar.from_json_schema(json.dumps({
        "type": "object", "properties": {"name": {"const": name}, "arguments": plan.parameters(name)},
        "required": ["name", "arguments"], "additionalProperties": False}), any_whitespace=False) for name in names]
    body = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)

    def literal(text: str):
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))

    one = str(xgr.Grammar.concat(literal(CALL_OPEN + "\n"), body, literal("\n" + CALL_CLOSE)))
    if not plan.parallel:
        return one
    # the one-call grammar's rules under another root name (its own rules are root_1, ...:
    # \b leaves them alone), and a root that repeats it
    return 'root ::= tool_call ("\\n" tool_call)*\n' + re.sub(r"\broot\b", "tool_call", one)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the content outside the call blocks, OpenAI tool_calls) of an answer. A block whose
    JSON does not parse, or has no name, stays in the content (as vLLM's hermes parser does)."""
    content, calls, rest = [], [], text
    while CALL_OPEN in rest:
        before, _, after = rest.partition(CALL_OPEN)
        inside, closed, rest = after.partition(CALL_CLOSE)
        try:
            call = json.loads(inside)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, TypeError, KeyError):
            content.append(before + CALL_OPEN + inside + closed)
            continue
        content.append(before)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    content.append(rest)
    return "".join(content).strip() if calls else "".join(content), calls


def held_back(text: str) -> int:
    """How many characters at the end of streamed text may start a call block (sent only once
    it is known they do not): from CALL_OPEN, or a prefix of it at the very end."""
    start = text.find(CALL_OPEN)
    if start >= 0:
        return len(text) - start
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:k]):
            return k
    return 0
