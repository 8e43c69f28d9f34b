"""Chat templates: the tokenizer's own or `api.chat_template` (a file path or inline Jinja), rendered in Jinja's
immutable sandbox with the globals HF templates expect (raise_exception, strftime_now, tojson)."""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from appliance.server.errors import ApiError

MAX_RENDERED_CHARS = 4 * 1024 * 1024  # a template that balloons its output is refused, not served
RENDER_TIME_LIMIT_S = 2.0  # a template that loops for longer is stopped (hostile messages, nested loops)


class _Timeout(Exception):
    pass


def _time_bounded(fn: Any, limit_s: float) -> Any:
    """Run `fn` with a line tracer on the compiled template's frames that stops it after `limit_s`.

    Jinja compiles templates to Python code (file name "<template>"), so a per-line deadline check there bounds
    any loop the template runs, without a subprocess; frames of other code run untraced, at full speed.
    """
    deadline = time.monotonic() + limit_s

    def local(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _Timeout
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(previous)


class TemplateError(ValueError):
    pass


def load_template_source(configured: str | None, tokenizer: Any) -> str | None:
    """`api.chat_template` wins: a readable file is read, anything else is an inline template."""
    if configured:
        if "{" not in configured and os.path.isfile(configured):
            with open(configured, encoding="utf-8") as f:
                return f.read()
        if "{" not in configured:
            raise TemplateError(f"api.chat_template: no such file {configured!r} (and not an inline template)")
        return configured
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):  # some tokenizers ship several named templates
        source = source.get("default") or next(iter(source.values()), None)
    return source if isinstance(source, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        if continue_final_message and add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise ApiError(400, "continue_final_message needs a final assistant message", param="messages")
        context = dict(template_kwargs or {})
        # the request's kwargs may add variables but not replace the ones the server owns
        context.update(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            text = _time_bounded(lambda: self._template.render(**context), RENDER_TIME_LIMIT_S)
        except _Timeout:
            raise ApiError(400, f"chat template rendering exceeded {RENDER_TIME_LIMIT_S:g} s",
                           param="messages") from None
        except TemplateError as exc:
            raise ApiError(400, f"chat template: {exc}", param="messages") from None
        except jinja2.exceptions.SecurityError:
            raise ApiError(400, "chat template tried an unsafe operation", param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ApiError(400, f"chat template failed on these messages ({type(exc).__name__})",
                           param="messages") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise ApiError(400, "rendered chat prompt is too large", param="messages")
        if continue_final_message:
            text = _cut_after_final(text, messages[-1])
        return text


def _cut_after_final(text: str, final: dict[str, Any]) -> str:
    """Drop what the template appends after the last message (end-of-turn tokens) so the model continues it."""
    content = final.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    content = (content or "").rstrip()
    if not content:
        return text
    idx = text.rfind(content)
    if idx < 0:
        raise ApiError(400, "continue_final_message: the template does not reproduce the final message",
                       param="messages")
    return text[: idx + len(content)]


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Pydantic messages -> plain dicts; text parts of multi-part content are joined (no images served)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=False)
        content = d.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages.{i}.content: only text parts are supported",
                                   param=f"messages.{i}.content")
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        if d.get("tool_calls"):
            d["tool_calls"] = [_template_tool_call(c, i) for c in d["tool_calls"]]
        out.append(d)
    return out


def _template_tool_call(call: Any, i: int) -> Any:
    """OpenAI sends a call's arguments as a JSON string; chat templates (Qwen, Llama 3, Mistral, DeepSeek) expect
    the object, as vLLM and SGLang pass it. Arguments that are not a JSON object stay as they are."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ApiError(400, f"messages.{i}.tool_calls: each call needs a function object", param=f"messages.{i}")
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call
