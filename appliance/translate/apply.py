"""Flag uses -> settings. Values are converted to the kind the schema declares for the target key and checked
against its allowed values; anything that does not fit becomes a finding, never a silent drop."""
from __future__ import annotations

import json
import re
from typing import Any

from appliance.translate import schema_view
from appliance.translate.argv import FlagUse
from appliance.translate.placeholders import interpolated
from appliance.translate.result import Pending, Translation, Use
from appliance.translate.shell import restore, unresolved_refs
from appliance.translate.spec import NO_VALUE, Flag

PLACEHOLDER = re.compile(r"<[A-Za-z_][^<>\s]*>|\{\{.*\}\}|^YOUR[_-][A-Z0-9_-]+$|/path/to/|^\.\.\.$|^xxx+$", re.I)


# where a scratch value (combined by rules.py) ends up, for values that have to be left to the user
SCRATCH_KEYS = {"@dist_host": "parallelism.dist_init_addr", "@dist_port": "parallelism.dist_init_addr",
                "@dp_local": "parallelism.nprocs_per_node", "@dp_start_rank": "parallelism.node_rank",
                "@chunked_prefill": "scheduler.chunked_prefill_size"}


class BadValue(ValueError):
    pass


def undecided(raw: str) -> str:
    """Why a raw word cannot be used as a value ('' when it can)."""
    refs = unresolved_refs(raw)
    if refs:
        return f"unresolved {', '.join(refs)}"
    if PLACEHOLDER.search(raw):
        return "placeholder"
    return ""


def convert(raw: Any, kind: str, choices: tuple[Any, ...] | None) -> Any:
    """A source value (word, list of words, parsed JSON) as the schema kind; BadValue when it does not fit."""
    if isinstance(raw, str):
        raw = restore(raw)
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            low = str(raw).lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise BadValue(f"{raw!r} is not a boolean")
        if kind == "int":
            value: Any = raw if isinstance(raw, int) else int(float(raw)) if re.fullmatch(r"-?\d+(\.0*)?", str(raw)) \
                else int(str(raw))
        elif kind == "float":
            value = float(raw)
        elif kind in ("list[int]", "list[str]"):
            items = raw if isinstance(raw, list) else [raw]
            flat: list[Any] = []
            for item in items:
                if isinstance(item, str) and item.strip().startswith("["):
                    flat.extend(json.loads(item))
                elif isinstance(item, str):
                    flat.extend(p for p in re.split(r"[,\s]+", item) if p)
                else:
                    flat.append(item)
            value = [int(x) for x in flat] if kind == "list[int]" else [str(x) for x in flat]
            if choices and any(v not in choices for v in value):
                raise BadValue(f"{value} has values outside {', '.join(map(str, choices))}")
            return value
        elif kind in ("dict", "section"):
            value = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(value, dict):
                raise BadValue(f"{raw!r} is not a JSON object")
        elif kind == "any":
            try:
                value = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                value = raw
        else:
            value = raw if isinstance(raw, str) else json.dumps(raw) if isinstance(raw, (dict, list)) else str(raw)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, BadValue):
            raise
        raise BadValue(f"{raw!r} is not a valid {kind}") from exc
    if choices and value not in choices:
        raise BadValue(f"{value!r} is not available here (choices: {', '.join(map(str, choices))})")
    return value


def _spelling(raw: Any, choices: tuple[Any, ...] | None) -> Any:
    """SGLang's and vLLM's spellings of one name (`gpt-oss`, `DeepSeek-R1`) as the schema's (`gpt_oss`)."""
    if not isinstance(raw, str) or not choices or restore(raw) in choices:
        return raw
    spelt = restore(raw).lower().replace("-", "_")
    return spelt if spelt in choices else raw


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`--hf-overrides '{...}' --hf-overrides.a.b 1`: later keys win, nested objects are merged."""
    merged = dict(base)
    for key, value in extra.items():
        old = merged.get(key)
        merged[key] = _merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return merged


def _implied(use: FlagUse) -> bool:
    """A use that needs no setting: the appliance always behaves that way, or the value changes nothing here."""
    flag, raw = use.flag, use.value
    if flag is None or use.problem:
        return False
    if flag.status == "implied":
        return True
    if isinstance(raw, str) and raw.lower() in flag.neutral:
        return True
    return flag.status in ("none", "removed") and flag.arity == "flag" and raw is False


class Applier:
    def __init__(self, out: Translation) -> None:
        self.out = out
        self.scratch: dict[str, tuple[Any, str]] = {}  # "@name" targets, combined by rules.py

    def apply(self, use: FlagUse) -> None:
        flag, out = use.flag, self.out
        out.uses.append(Use(use.written, use.display, _implied(use)))
        if use.problem and flag is None:
            out.warn(use.written, use.problem, unmapped=True)
            return
        if flag is None:
            out.warn(use.written, f"not a {out.title} flag this translator knows (a typo, or newer than its "
                     "table); not translated", unmapped=True)
            return
        if use.problem:
            out.warn(use.written, use.problem, unmapped=True)
            return
        raw = use.value
        word = raw if isinstance(raw, str) else ""
        if flag.status in ("none", "removed"):
            if word and word.lower() in flag.neutral:
                out.note(use.display, f"no equivalent ({flag.note}); {word} is how the appliance behaves anyway")
            elif flag.arity == "flag" and raw is False:
                out.note(use.display, f"switched off, which is the behaviour here ({flag.note})")
            else:
                what = "removed from " + out.title if flag.status == "removed" else "no equivalent"
                out.warn(use.display, f"{what}: {flag.note}" if flag.status == "none" else flag.note, unmapped=True)
            return
        if flag.status == "implied":
            out.note(use.display, flag.note)
            return
        if word and word.lower() in flag.neutral:  # e.g. --max-model-len auto: the unset key means the same
            out.note(use.display, f"{word} is what {flag.target} means when unset; nothing to set")
            return
        assert flag.target is not None
        if flag.arity == "json" or use.subkey is not None:
            self._json(flag, use)
            return
        if flag.arity in ("flag", "optional") and (raw is NO_VALUE or isinstance(raw, bool) or flag.const is True):
            self._switch(flag, use)
            return
        if raw is NO_VALUE:
            out.warn(use.written, "expects a value; not translated", unmapped=True)
            return
        self.put(flag, flag.target, raw, use.display)

    def _switch(self, flag: Flag, use: FlagUse) -> None:
        """A switch (`--x`, `--no-x`, Atlas `--x [true|false]`): sets True/False, or `const` when on."""
        raw, out = use.value, self.out
        if raw is NO_VALUE and flag.arity == "optional" and flag.const is None:
            out.warn(use.written, "given without a value; the appliance needs one here", unmapped=True)
            return
        try:
            on = True if raw is NO_VALUE else raw if isinstance(raw, bool) else convert(raw, "bool", None)
        except BadValue as exc:
            out.warn(use.display, str(exc), unmapped=True)
            return
        const = True if flag.const is None else flag.const
        if isinstance(const, bool):
            value: Any = on if const else not on
        elif on:
            value = const
        else:
            out.note(use.display, "switched off: nothing to set")
            return
        self.put(flag, flag.target or "", value, use.display, from_word=False)

    def put(self, flag: Flag, target: str, raw: Any, source: str, from_word: bool = True) -> None:
        """Map, convert and store one value (or hold it as pending / scratch)."""
        out = self.out
        words = raw if isinstance(raw, list) else [raw] if isinstance(raw, str) else []
        for w in words:
            why = undecided(w)
            if why:
                self._undecided(target, words, source, why)
                return
        if from_word and isinstance(raw, str):
            mapped = flag.value_map().get(restore(raw).lower(), NO_VALUE)
            if mapped is NO_VALUE and flag.closed:
                out.warn(source, f"value {restore(raw)!r} has no equivalent here (known: "
                         f"{', '.join(k for k, _ in flag.values)})", unmapped=True)
                return
            raw = raw if mapped is NO_VALUE else mapped
        if target.startswith("@"):
            self.scratch[target] = (raw if not isinstance(raw, str) else restore(raw), source)
            return
        self.store(target, raw, source, flag.note if flag.status == "similar" else "")

    def _undecided(self, target: str, words: list[str], source: str, why: str) -> None:
        """A value the script leaves to its environment: `${oc.env:VAR}` interpolation where one variable (or a
        named placeholder) stands for it, verbatim in a text field, else pending (commented out)."""
        out = self.out
        key = SCRATCH_KEYS.get(target, target)
        info = schema_view.key_info(key)
        text_field = info is not None and info.kind == "str" and info.choices is None
        interp = interpolated(words[0]) if len(words) == 1 else None
        if interp is not None and (text_field or target.startswith("@") or info is not None):
            names = ", ".join(interp.variables)
            out.note(source, f"{why}: kept as {interp.text}, resolved from the environment when the appliance "
                     f"starts (set {names} there)")
            if target.startswith("@"):
                self.scratch[target] = (interp.text, source)
            else:
                out.set(target, interp.text, source)
            return
        if text_field or target == "@dist_host":
            text = restore(" ".join(words))
            out.note(source, f"{why}: {key} keeps {text!r} verbatim; replace it before use")
            if target.startswith("@"):
                self.scratch[target] = (text, source)
            else:
                out.set(target, text, source)
            return
        out.pending.append(Pending(key, restore(" ".join(words)), source, why))
        out.warn(source, f"{why}: {key} is left commented out; fill it in")

    def store(self, target: str, raw: Any, source: str, note: str = "") -> None:
        out = self.out
        info = schema_view.key_info(target)
        if info is None:
            out.warn(source, f"the schema has no key {target} (translator table out of date)", unmapped=True)
            return
        parent = target.rsplit(".", 1)[0]
        parent_info = schema_view.key_info(parent) if "." in parent else None
        try:
            if info.kind == "section":
                value = convert(raw, "dict", None)
                flag_name = source.split(" ", 1)[0]
                for key, sub in value.items():
                    self.store(f"{target}.{key}", sub, f"{flag_name} {key}={json.dumps(sub)}", note)
                return
            if info.kind == "str" and isinstance(raw, list):
                if len(raw) > 1:
                    out.warn(source, f"only the first of {len(raw)} values is kept ({target} takes one)",
                             unmapped=True)
                raw = raw[0]
            value = convert(_spelling(raw, info.choices), info.kind, info.choices)
            if info.kind not in ("dict", "any"):
                value = schema_view.normalized(target, value)
        except (BadValue, ValueError) as exc:
            out.warn(source, f"{exc}; {target} not set", unmapped=True)
            return
        if parent_info is not None and parent_info.kind == "dict":  # a key inside a free dict (hf_overrides)
            merged = dict(out.get(parent) or {})
            merged[target.rsplit(".", 1)[1]] = value
            out.set(parent, merged, source, note)
            return
        if info.kind == "dict" and isinstance(out.get(target), dict):
            value = _merge(out.get(target), value)
        out.set(target, value, source, note)

    def _json(self, flag: Flag, use: FlagUse) -> None:
        out = self.out
        if use.subkey is not None:
            doc: Any = {}
            node = doc
            *parents, leaf = use.subkey.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            text = restore(use.value) if isinstance(use.value, str) else use.value
            try:
                node[leaf] = json.loads(text) if isinstance(text, str) else text
            except ValueError:
                node[leaf] = text
        else:
            if not isinstance(use.value, str):
                out.warn(use.written, "expects a JSON value; not translated", unmapped=True)
                return
            why = undecided(use.value)
            try:
                doc = json.loads(restore(use.value))
            except ValueError:
                if why:
                    out.pending.append(Pending(flag.target or "", restore(use.value), use.display, why))
                    out.warn(use.display, f"{why}; left commented out")
                    return
                doc = restore(use.value)  # a bare word: vLLM reads `-O3` as {"level": 3}
        if not isinstance(doc, dict):
            doc = {"level": doc} if flag.subkeys else doc
        if not flag.subkeys:
            self.store(flag.target or "", doc, use.display, flag.note if flag.status == "similar" else "")
            return
        table = dict(flag.subkeys)
        for key, value in doc.items():
            dest = table.get(key)
            source = use.display if use.subkey is not None else f"{use.written} {key}={json.dumps(value)}"
            if dest is None:
                out.warn(source, f"key {key!r} of {flag.canonical} has no equivalent here", unmapped=True)
            elif dest == "-":
                out.note(source, flag.note)
            else:
                word = value if isinstance(value, str) else json.dumps(value)
                mapped = flag.value_map().get(word.lower(), NO_VALUE) if isinstance(value, str) else NO_VALUE
                self.store(dest, value if mapped is NO_VALUE else mapped, source,
                           flag.note if flag.status == "similar" else "")
