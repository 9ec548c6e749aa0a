#!/usr/bin/env python3
"""Compares kvroute's chat rendering (`kvroute tokenize --text`) with transformers' renderer
fed the conversation vLLM builds, over a set of sample conversations, for each model
directory given (its `tokenizer_config.json`, and `chat_template.jinja` or
`chat_template.json` where it has one). A difference means kvroute's local tokenizer would
make other tokens than the engine for that kind of request, and precise prefix routing
would miss without an error anywhere: docs/kv-events.md ("Templates checked against
transformers") has the directories checked and what they found.

The rendering is what is compared, so the directories need no `tokenizer.json` of their
own: each is paired with TOKENIZER_JSON (by default the lab's test tokenizer). Against a
serving pod, with the model's own tokenizer, `kvroute tokenize --pod` is the check.

Needs `pip install transformers jinja2 pydantic openai` (no PyTorch); CI does not run
this.

    cargo build --release --bin kvroute
    python3 scripts/compare-chat-templates.py [--kvroute BIN] [--tokenizer-json FILE]
        [--random N] [--texts N] [--seed S] DIR...

scripts/templates/python-strings is a template of our own that puts every string method
and filter a template may call on each message's content into the prompt (with `--texts`).

Exit status 1 when some rendering differs.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections import deque

import jinja2.nodes as N
from transformers.utils.chat_template_utils import (
    _compile_jinja_template,
    render_jinja_template,
)

# vLLM's request models for what it hands a template as tools and tool calls (entrypoints'
# protocol: extra fields allowed; OpenAI's typed dict for a tool call), so that pydantic
# itself decides the fields' order and defaults. Needs `pip install pydantic openai`.
from typing import Any, Literal

from openai.types.chat import ChatCompletionMessageToolCallParam
from pydantic import BaseModel, ConfigDict, TypeAdapter


class _VllmModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(_VllmModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolsParam(_VllmModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


TOOL_CALLS = TypeAdapter(list[ChatCompletionMessageToolCallParam])

SPECIAL = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]

# Tools as agents send them: a described function with a JSON schema (its properties in
# an order that is not sorted), and a bare one.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "city": {"type": "string", "description": "City name, e.g. Paris"}},
            "required": ["city"]}}},
    {"function": {"name": "get_time"}, "type": "function"},
]

CASES = [
    ("one user", {"messages": [{"role": "user", "content": "Hello there, how are you?"}]}),
    ("system+user", {"messages": [
        {"role": "system", "content": "You are a careful assistant.\nAnswer briefly."},
        {"role": "user", "content": "What is a KV cache?"}]}),
    ("multi-turn", {"messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "It stores attention keys and values."},
        {"role": "user", "content": "  And why does it fill up?  \n"}]}),
    ("parts", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]}]}),
    ("no generation prompt", {"add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}),
    ("name", {"messages": [{"role": "user", "name": "ann", "content": "Hi, I am Ann."}]}),
    ("unicode and braces", {"messages": [
        {"role": "user", "content": "Ünïcödé — 日本語 {{ not a template }} {% neither %} \\n"}]}),
    ("null assistant content", {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"}]}),
    ("reasoning", {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
        {"role": "user", "content": "3+3?"}]}),
    ("thinking off", {"chat_template_kwargs": {"enable_thinking": False}, "messages": [
        {"role": "user", "content": "Hi"}]}),
    ("thinking on", {"chat_template_kwargs": {"enable_thinking": True}, "messages": [
        {"role": "user", "content": "Hi"}]}),
    ("tools", {"tools": TOOLS, "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"}]}),
    ("tool call and result", {"tools": TOOLS, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call9abcd", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call9abcd", "content": "18 degrees, cloudy"}]}),
    ("parallel calls, content", {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            {"type": "function", "function": {"arguments": "{\"city\": \"Paris\"}", "name": "get_weather"}, "id": "call1abcd"},
            {"id": "call2abcd", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call1abcd", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "call2abcd", "content": [{"type": "text", "text": "09:00"}]},
        {"role": "user", "content": "Thanks!"}]}),
    ("documents", {"documents": [
        {"title": "Scrapes", "text": "Every pod is scraped every 50 ms."},
        {"text": "Envoy asks kvroute for each request.", "title": "Routing"}], "messages": [
        {"role": "user", "content": "How often are pods scraped?"}]}),
    ("continue final message", {"continue_final_message": True, "add_generation_prompt": False,
        "messages": [{"role": "user", "content": "Name a color."},
                     {"role": "assistant", "content": "The color is "}]}),
    ("wide integers", {"tools": [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 18446744073709551615,
                                               "minimum": -9223372036854775808}}}}}],
        "messages": [
        {"role": "user", "content": "Pick two numbers."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call9abcd", "type": "function",
             "function": {"name": "pick", "arguments": "{\"a\": 123456789012345678901234567890, \"b\": 1e21, \"c\": 18446744073709551615}"}}]},
        {"role": "tool", "tool_call_id": "call9abcd", "content": "done"}]}),
    ("tool history, no tools", {"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call9abcd", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call9abcd", "content": "18 degrees"},
        {"role": "assistant", "content": "It is 18 degrees."},
        {"role": "user", "content": "Thanks"}]}),
]


# Random agent conversations (`--random N`): tools with their fields in either order, some
# left out, tool calls whose keys come in any order and whose arguments hold strings with
# quotes, escapes and non-ASCII text, integers, floats Python writes in exponent form,
# booleans, nulls, nested lists and objects (written with or without ASCII escapes), empty
# arguments.
TEXTS = ["city", "unit", "ünïcode", "日本", 'a"quote', "back\\slash", "tab\tx", "new\nline",
         "emoji 🎉", "", " spaced "]


def random_value(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.25:
        return rng.choice(TEXTS)
    if r < 0.35:
        return rng.randint(-10**12, 10**12)
    if r < 0.45:
        return rng.choice([0.1, 1.0, -2.5e-7, 1e21, 3.14159, 100.0, 1e16, 123456789.123])
    if r < 0.5:
        return rng.choice([True, False, None])
    if r < 0.75:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(TEXTS) + str(i): random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def shuffled(rng, mapping):
    items = list(mapping.items())
    rng.shuffle(items)
    return dict(items)


def random_tool(rng):
    parameters = {"type": "object", "properties": {t: {"type": "string"} for t in rng.sample(TEXTS, 3)}}
    function = {"name": rng.choice(["get_weather", "search", "run"])}
    for key, value in shuffled(rng, {"description": rng.choice(TEXTS), "parameters": parameters,
                                     "strict": True}).items():
        if rng.random() < 0.6:
            function[key] = value
    return shuffled(rng, {"type": "function", "function": function})


def random_call(rng, i):
    arguments = {rng.choice(TEXTS) + str(j): random_value(rng) for j in range(rng.randint(0, 3))}
    text = "" if rng.random() < 0.2 else json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
    return shuffled(rng, {"id": f"call{i}abcde", "type": "function",
                          "function": shuffled(rng, {"name": "get_weather", "arguments": text})})


def random_case(rng):
    messages = [{"role": "user", "content": rng.choice(TEXTS) or "question"}]
    for i in range(rng.randint(0, 2)):
        messages.append({"role": "assistant", "content": rng.choice([None, "", "Checking."]),
                         "tool_calls": [random_call(rng, i)]})
        messages.append({"role": "tool", "tool_call_id": f"call{i}abcde", "content": str(random_value(rng))})
    messages.append({"role": "user", "content": "And next?"})
    body = {"messages": messages}
    if rng.random() < 0.8:
        body["tools"] = [random_tool(rng) for _ in range(rng.randint(0, 3))]
    return body


# vLLM's content-format detection (entrypoints/chat_utils.py), restated.
def _is_var(node, name):
    return isinstance(node, N.Name) and node.ctx == "load" and node.name == name


def _is_attr(node, name, key):
    if isinstance(node, N.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, N.Const) and node.arg.value == key
    if isinstance(node, N.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node, name, key=None):
    if isinstance(node, N.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, N.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, N.Getitem) and isinstance(node.arg, N.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def content_format(template):
    root = _compile_jinja_template(template).environment.parse(template)
    names = ["messages"]
    queue = deque(["messages"])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(N.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, N.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    message_vars = [
        loop.target.name for loop in root.find_all(N.For)
        if any(_is_var_or_elems(loop.iter, n) for n in names) and isinstance(loop.target, N.Name)
    ]
    for loop in root.find_all(N.For):
        if any(_is_var_or_elems(loop.iter, m, "content") for m in message_vars):
            return "openai"
    return "string"


def token_text(value):
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return value.get("content")


def load(model_dir):
    config = json.load(open(os.path.join(model_dir, "tokenizer_config.json")))
    template = None
    for name in ["chat_template.jinja"]:
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            template = open(path, encoding="utf-8").read()
    if template is None and os.path.exists(os.path.join(model_dir, "chat_template.json")):
        template = json.load(open(os.path.join(model_dir, "chat_template.json")))["chat_template"]
    tool_use = None
    if template is None:
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t["name"]: t["template"] for t in template}
            template, tool_use = named.get("default"), named.get("tool_use")
    specials = {}
    mapping = {}
    if os.path.exists(os.path.join(model_dir, "special_tokens_map.json")):
        mapping = json.load(open(os.path.join(model_dir, "special_tokens_map.json")))
    for name in SPECIAL:
        text = token_text(config.get(name)) or token_text(mapping.get(name))
        if text is not None:
            specials[name] = text
    return config, (template, tool_use), specials


def vllm_conversation(messages, fmt):
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        else:
            texts = [p["text"] for p in content]
        if fmt == "openai":
            content = [{"type": "text", "text": t} for t in texts]
        else:
            content = "\n".join(texts)
        message = {"role": m["role"], "content": content}
        if m["role"] == "assistant":
            if m.get("tool_calls") is not None:
                calls = TOOL_CALLS.validate_python(m["tool_calls"])
                # _postprocess_messages: arguments parsed, an empty list dropped.
                for call in calls:
                    arguments = call["function"].get("arguments")
                    call["function"]["arguments"] = json.loads(arguments) if arguments else {}
                if calls:
                    message["tool_calls"] = calls
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if reasoning is not None:
                message["reasoning"] = reasoning
                message["reasoning_content"] = reasoning
        elif m["role"] == "tool" and "tool_call_id" in m:
            message["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        if m["role"] == "developer":
            message["tools"] = m.get("tools")
        out.append(message)
    return out


def reference(templates, specials, body):
    tools = body.get("tools")
    if tools is not None:
        tools = [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]
    default, tool_use = templates
    # transformers' choice among named templates.
    template = tool_use if tools is not None and tool_use is not None else default
    fmt = content_format(template)
    conversation = vllm_conversation(body["messages"], fmt)
    kwargs = dict(specials)
    kwargs["add_generation_prompt"] = body.get("add_generation_prompt", True)
    kwargs["continue_final_message"] = body.get("continue_final_message", False)
    kwargs.update(body.get("chat_template_kwargs") or {})
    agp = kwargs.pop("add_generation_prompt")
    if agp and kwargs["continue_final_message"]:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    rendered, _ = render_jinja_template(
        conversations=[conversation], tools=tools, documents=body.get("documents"),
        chat_template=template, add_generation_prompt=agp, **kwargs)
    return rendered[0], fmt


def kvroute(binary, tokenizer_dir, body):
    proc = subprocess.run(
        [binary, "tokenize", "--tokenizer", tokenizer_dir, "--text", "-"],
        input=json.dumps(body).encode(), capture_output=True)
    if proc.returncode != 0:
        return None, proc.stderr.decode().strip()
    report = json.loads(proc.stdout)
    local = report["local"]
    if "text" in local:
        return local["text"], None
    return None, local.get("asks_a_pod")


def first_diff(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


# Random plain conversations (`--texts N`) whose contents hold what Python's string methods
# read otherwise than Rust's: its white space (U+001C-U+001F, no-break spaces) and line
# breaks (a lone \r, \v, \f, U+0085, U+2028), letters whose case changes their length
# (ß, ǆ, ligatures), words after digits and apostrophes, non-ASCII text before a match.
AWKWARD = ["\x1c lead and trail \x1f", "no\u00a0break\u2003space", "cr\ronly", "crlf\r\nline",
           "vt\x0bff\x0cnel\x85ls\u2028ps\u2029end", "straße 1st o'neil-smith", "ǆungla ﬁne",
           "日本 e here", "  padded  ", "\n", "", "UPPER lower Title", "e", "tab\tand\nnewline\n"]


def random_text_case(rng):
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(AWKWARD)})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": rng.choice(AWKWARD) + rng.choice(AWKWARD)})
        messages.append({"role": "assistant", "content": rng.choice(AWKWARD)})
    messages.append({"role": "user", "content": rng.choice(AWKWARD)})
    return {"messages": messages}


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvroute", default=os.path.join(root, "target/release/kvroute"))
    parser.add_argument("--tokenizer-json",
                        default=os.path.join(root, "crates/lab/tokenizers/bpe-4k/tokenizer.json"))
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="also N random agent conversations (tools, tool calls) per directory")
    parser.add_argument("--texts", type=int, default=0, metavar="N",
                        help="also N random plain conversations of awkward texts per directory")
    parser.add_argument("--seed", type=int, default=1, help="of the random conversations")
    parser.add_argument("dirs", nargs="+", metavar="DIR")
    args = parser.parse_args()
    binary, tokenizer_json, dirs = args.kvroute, args.tokenizer_json, args.dirs
    rng = random.Random(args.seed)
    cases = CASES + [(f"random {k}", random_case(rng)) for k in range(args.random)]
    cases += [(f"texts {k}", random_text_case(rng)) for k in range(args.texts)]
    failures = 0
    counts = {}
    for model_dir in dirs:
        name = os.path.basename(os.path.normpath(model_dir))
        config, templates, specials = load(model_dir)
        with tempfile.TemporaryDirectory() as work:
            shutil.copy(tokenizer_json, os.path.join(work, "tokenizer.json"))
            for f in ["tokenizer_config.json", "chat_template.jinja", "chat_template.json", "special_tokens_map.json"]:
                if os.path.exists(os.path.join(model_dir, f)):
                    shutil.copy(os.path.join(model_dir, f), os.path.join(work, f))
            for case, body in cases:
                body = dict(body, model="m")
                try:
                    expected, fmt = reference(templates, specials, body)
                    ref_error = None
                except Exception as e:  # the template refused (raise_exception) or failed
                    expected, fmt, ref_error = None, "?", f"{type(e).__name__}: {e}"
                got, why = kvroute(binary, work, body)
                if expected is not None and got == expected:
                    status = "same"
                elif expected is None and got is None:
                    status = "both refuse"
                elif got is None:
                    status = "kvroute asks a pod"
                elif expected is None:
                    # Harmless: the engine fails the request whatever kvroute matched.
                    status = "the engine refuses, kvroute renders"
                else:
                    status = "DIFFERENT"
                    failures += 1
                counts[status] = counts.get(status, 0) + 1
                print(f"{name:28} {case:24} {fmt:7} {status}" + (f"  [kvroute: {why}]" if why and status != "same" else "") + (f"  [reference: {ref_error}]" if ref_error else ""))
                if status == "DIFFERENT":
                    at = first_diff(got, expected or "")
                    print("    kvroute  :", repr(got[max(0, at - 60):at + 60]))
                    print("    reference:", repr((expected or "")[max(0, at - 60):at + 60]))
    print("; ".join(f"{status}: {n}" for status, n in sorted(counts.items())))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
