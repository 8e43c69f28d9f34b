"""Appliance TOML -> the equivalent vLLM or SGLang command, read off the same flag tables backwards, so one
deployment can be A/B-tested on both. Settings the engine cannot express are listed, never dropped silently."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from appliance.translate import schema_view
from appliance.translate.placeholders import to_shell
from appliance.translate.spec import EngineTable, Flag
from appliance.translate.tables import TABLES

LAUNCHERS = {"vllm": ["vllm", "serve"], "sglang": ["python", "-m", "sglang.launch_server"]}


@dataclass(frozen=True)
class Command:
    engine: str
    argv: list[str]
    inexpressible: dict[str, Any]  # path -> value the engine has no flag for
    head: int  # words of the first line (launcher, and the positional model of `vllm serve`)

    def render(self) -> str:
        lines = [f"# {path} = {json.dumps(value)}: no {TABLES[self.engine].title} equivalent"
                 for path, value in self.inexpressible.items()]
        words = self.argv
        body, i = [_join(words[:self.head])], self.head
        while i < len(words):
            j = i + 1
            while j < len(words) and not words[j].startswith("--"):
                j += 1
            body.append("    " + _join(words[i:j]))
            i = j
        return "\n".join(lines + [" \\\n".join(body)]) + "\n"


def _join(words: list[str]) -> str:
    """shlex.join, except that a word reading an environment variable is double-quoted so the shell expands it."""
    return " ".join('"' + re.sub(r'(["\\`])', r"\\\1", w) + '"' if "${" in w else shlex.quote(w)
                    for w in words)


def leaves(document: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a config document to "section.key" -> value; free dicts (hf_overrides) stay whole."""
    out: dict[str, Any] = {}
    for key, value in document.items():
        path = f"{prefix}{key}"
        info = schema_view.key_info(path) if prefix else None
        if isinstance(value, dict) and (not prefix or info is None or info.kind == "section"):
            out.update(leaves(value, path + "."))
        else:
            out[path] = value
    return out


def _preferred(table: EngineTable) -> dict[str, Flag]:
    """target -> the flag that best expresses it: same before similar, table order otherwise."""
    best: dict[str, Flag] = {}
    for status in ("same", "similar"):
        for flag in table.flags:
            if flag.status == status and flag.target and flag.target not in best and not flag.subkeys:
                best[flag.target] = flag
    return best


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return to_shell(str(value))


def _source_value(flag: Flag, value: Any) -> Any:
    for src, dest in flag.values:
        if dest == value:
            return src
    return value


def to_command(document: dict[str, Any], engine: str) -> Command:
    table = TABLES[engine]
    values = leaves(document)
    best = _preferred(table)
    argv = list(LAUNCHERS[engine])
    if engine == "vllm" and "model.path" in values:  # `vllm serve MODEL`
        argv.append(to_shell(str(values.pop("model.path"))))
    head = len(argv)
    left: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}  # JSON flags assembled key by key
    values = _special(engine, values, argv)
    for path, value in values.items():
        flag = best.get(path)
        parent = path.rsplit(".", 1)[0]
        if flag is None and parent in best and best[parent].arity == "json":
            groups.setdefault(best[parent].canonical, {})[path.rsplit(".", 1)[1]] = value
            continue
        if flag is None:
            sub = next(((f, src) for f in table.flags if f.subkeys for src, dest in f.subkeys if dest == path), None)
            if sub is not None:
                groups.setdefault(sub[0].canonical, {})[sub[1]] = _source_value(sub[0], value)
            else:
                left[path] = value
            continue
        words = _flag_words(flag, value)
        if words is None:
            left[path] = value
        else:
            argv.extend(words)
    for name, doc in groups.items():
        argv.extend([name, json.dumps(doc)])
    return Command(engine, argv, left, head)


def _flag_words(flag: Flag, value: Any) -> list[str] | None:
    name = flag.canonical
    if flag.arity == "flag":
        if flag.const is None or flag.const is True:
            return [name] if value else (["--no-" + name[2:]] if flag.negatable else [])
        if flag.const is False:
            return [name] if value is False else []
        return [name] if value == flag.const else None
    if flag.target and flag.target.startswith("@"):
        return None
    if flag.closed and value not in [dest for _, dest in flag.values]:
        return None  # the engine has no name for this value
    value = _source_value(flag, value)
    if flag.arity == "list":
        items = value if isinstance(value, list) else [value]
        return [name, *map(_word, items)] if items else []
    return [name, _word(value)]


def _special(engine: str, values: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """Settings one flag cannot carry alone; handled here and taken out of `values`."""
    values = dict(values)
    addr = values.get("parallelism.dist_init_addr")
    split = re.fullmatch(r"(.+?):(\$\{oc\.env:[^}]*\}|[^:]+)", addr) if isinstance(addr, str) else None
    if engine == "vllm" and split is not None:  # host:port, either part possibly `${oc.env:VAR}`
        argv.extend(["--master-addr", to_shell(split.group(1)), "--master-port", to_shell(split.group(2))])
        values.pop("parallelism.dist_init_addr")
    if engine == "vllm" and values.get("scheduler.chunked_prefill_size") == -1:
        values.pop("scheduler.chunked_prefill_size")
        argv.append("--no-enable-chunked-prefill")
        if "scheduler.max_prefill_tokens" in values:
            argv.extend(["--max-num-batched-tokens", str(values.pop("scheduler.max_prefill_tokens"))])
    if engine == "vllm" and values.get("backends.all2all") == "deepep":
        mode = values.pop("backends.deepep_mode", "auto")
        values.pop("backends.all2all")
        argv.extend(["--all2all-backend",
                     "deepep_low_latency" if mode == "low_latency" else "deepep_high_throughput"])
    if engine == "vllm" and values.get("speculative.ngram_proposer") == "device" \
            and values.get("speculative.algorithm") == "NGRAM":
        values.pop("speculative.ngram_proposer")
        values["speculative.algorithm"] = "ngram_gpu"  # vLLM's method name (no table value maps back to it)
    tp, dp, dense = (values.get(f"parallelism.{k}", 1) for k in ("tp", "dp", "dense_tp"))
    if engine == "sglang" and isinstance(dense, int) and dense > tp and dense == tp * dp:
        # split parallelism with attention replicas is SGLang's --tp T --dp D --enable-dp-attention
        for key in ("tp", "dense_tp") + (("moe_tp",) if values.get("parallelism.moe_tp") == dense else ()):
            values.pop(f"parallelism.{key}", None)
        values["parallelism.tp"] = dense
        argv.append("--enable-dp-attention")
    if engine == "sglang" and values.get("parallelism.enable_expert_parallel") and "parallelism.ep" not in values:
        values.pop("parallelism.enable_expert_parallel")
        argv.extend(["--ep-size", str(values.get("parallelism.tp", 1) * values.get("parallelism.dp", 1))])
    elif engine == "sglang" and values.get("parallelism.enable_expert_parallel"):
        values.pop("parallelism.enable_expert_parallel")  # --ep-size alone turns it on in SGLang
    return values
