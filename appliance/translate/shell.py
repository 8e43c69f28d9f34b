"""Shell scripts -> simple commands: continuations, comments, redirections, quoting, `export`, `VAR=x cmd`.

Tokenizing is shlex's. Two things shlex loses are settled before it runs, by one pass over the text:
- which `$` may expand: a `$` inside single quotes or escaped is replaced by LITERAL_DOLLAR, a `$` inside double
  quotes by QUOTED_DOLLAR (expands, but is not word-split), a bare `$` stays (expands and is word-split);
- comments after a continuation, which bash would treat as the end of the command but people mean as a note.
Variables are expanded only from assignments made earlier in the same script; anything else stays `$NAME`
in the word (a real `$` therefore always means "unresolved") and is reported, never guessed.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

LITERAL_DOLLAR = "\x01"
QUOTED_DOLLAR = "\x02"
SEPARATORS = {";", "&&", "||", "|", "&", ";;", "|&"}
_KEYWORDS = {"then", "do", "else", "elif", "if", "while", "until", "!", "{", "(", "time"}
_ENDERS = {"fi", "done", "}", ")", "esac"}
_REDIRECT = re.compile(r"(\d*|&)(>>|>\||>&|<<<|<<|<&|>|<)")
_PLACEHOLDER = re.compile(r"<[A-Za-z_][^<>\s]*>")  # `<MODEL>` in docs-style commands, not a redirection
_REF = re.compile(r"([$\x02])(\{([A-Za-z_]\w*)([^}]*)\}|([A-Za-z_]\w*)|([0-9@*#?$!]))")
_ASSIGN = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)
UNRESOLVED = re.compile(r"\$(\{[^}]*\}|[A-Za-z_]\w*|\([^)]*\)+|[0-9@*#?$!])")


class ShellSyntaxError(ValueError):
    """The text cannot be read as a shell script (an unterminated quote, say)."""


@dataclass(frozen=True)
class ShellCommand:
    argv: tuple[str, ...]  # words; LITERAL_DOLLAR stands for a literal `$`, a real `$` for an unresolved reference
    env: tuple[tuple[str, str], ...]  # exported variables and `VAR=x` prefixes in effect for this command
    line: int  # first physical line (1-based)
    unresolved: tuple[str, ...]  # references that could not be expanded, e.g. ("$NODE_RANK",)


def restore(word: str) -> str:
    """A word as the user wrote it (literal dollars back)."""
    return word.replace(LITERAL_DOLLAR, "$")


def unresolved_refs(word: str) -> list[str]:
    return [m.group(0) for m in UNRESOLVED.finditer(word)]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join continuations, drop comments and redirections, mark dollars. Returns (first line, text) pairs."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    line, start, i, n = 1, 1, 0, len(text)
    quote = ""
    continued = False  # a continuation was just consumed and only blanks followed on the new line
    while i < n:
        ch = text[i]
        if quote == "'":
            buf.append(LITERAL_DOLLAR if ch == "$" else ch)
            quote = "" if ch == "'" else quote
        elif ch == "\\" and i + 1 < n:
            nxt = text[i + 1]
            rest = re.match(r"[ \t]*\r?\n", text[i + 1:])
            if rest and not quote:  # continuation (trailing blanks after the backslash forgiven)
                i += 1 + rest.end()
                line += 1
                continued = True
                buf.append(" ")
                continue
            buf.append("\\" + (LITERAL_DOLLAR if nxt == "$" else nxt))
            i += 2
            continue
        elif quote == '"':
            buf.append(QUOTED_DOLLAR if ch == "$" else ch)
            quote = "" if ch == '"' else quote
        elif ch in "'\"":
            quote = ch
            buf.append(ch)
        elif ch == "#" and (not buf or buf[-1] in " \t\n;&|"):
            end = text.find("\n", i)
            end = n if end < 0 else end
            comment = text[i:end].rstrip()
            if continued or comment.endswith("\\"):  # a note inside a continued command: keep going
                i = end + 1
                line += 1
                continued = True
                buf.append(" ")
                continue
            i = end
            continue
        elif ch == "\n":
            if "".join(buf).strip():
                out.append((start, "".join(buf)))
            buf, line, start, continued = [], line + 1, line + 1, False
            i += 1
            continue
        elif (m := _REDIRECT.match(text, i)) and (not buf or buf[-1] in " \t;&|") \
                and not _PLACEHOLDER.match(text, i):
            j = m.end()
            while j < n and text[j] in " \t":
                j += 1
            while j < n and text[j] not in " \t\n;&|":
                j += 1
            i = j
            continue
        else:
            buf.append(ch)
            if ch not in " \t\r":
                continued = False
        if ch == "\n":
            line += 1
        i += 1
    if quote:
        raise ShellSyntaxError(f"unterminated {quote} quote starting before line {line}")
    if "".join(buf).strip():
        out.append((start, "".join(buf)))
    return out


def _protect_substitutions(text: str) -> str:
    """`$(cmd args)` would be split by shlex; squeeze it into one word that stays unresolved."""
    out, i = [], 0
    while i < len(text):
        if text[i] in "$\x02" and text.startswith("(", i + 1):
            depth, j = 0, i + 1
            while j < len(text):
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            out.append("$(" + text[i + 2:j].replace(" ", "_") + ")")
            i = j + 1
        elif text[i] == "`":
            j = text.find("`", i + 1)
            j = len(text) if j < 0 else j
            out.append("$(" + text[i + 1:j].replace(" ", "_") + ")")
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _split(text: str) -> list[list[str]]:
    lexer = shlex.shlex(_protect_substitutions(text), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise ShellSyntaxError(str(exc)) from exc
    commands: list[list[str]] = [[]]
    for tok in tokens:
        if tok in SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(tok)
    return [c for c in commands if c]


def _expand(word: str, env: dict[str, str], missing: list[str]) -> list[str]:
    """Expand references from `env`; a whole-word unquoted `$X` is word-split like the shell does."""
    def sub(m: re.Match[str]) -> str:
        name, mod = m.group(3) or m.group(5), m.group(4) or ""
        if name and name in env and (mod == "" or mod.startswith((":-", "-", ":=", "="))):
            return env[name]
        ref = "$" + m.group(2)
        missing.append(ref)
        return ref

    whole = _REF.fullmatch(word)
    expanded = _REF.sub(sub, word)
    if whole and whole.group(1) == "$" and expanded != word:
        return shlex.split(expanded) if expanded.strip() else []
    return [expanded.replace(QUOTED_DOLLAR, "$")]


# a copied terminal prompt in front of a command (`$ vllm serve ...`, `(venv) $ ...`): not valid shell anyway
_PROMPT = re.compile(r"^[ \t]*(?:\([\w.-]+\)[ \t]*)?[$%][ \t]+(?=\S)", re.M)
_HEREDOC = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_]\w*)\2")
_WRITES = re.compile(r"^\s*(?:cat\b[^>|]*>\s*|cat\b.*\|\s*(?:sudo\s+)?tee\s+(?:-a\s+)?)([^\s;&|<>]+)")


def heredocs(text: str) -> tuple[str, dict[str, str]]:
    """The script with here-document bodies blanked out (lines kept, so line numbers hold), and the files that
    `cat > FILE << EOF` / `cat << EOF | tee FILE` write from them (name -> text)."""
    lines = text.split("\n")
    files: dict[str, str] = {}
    i = 0
    while i < len(lines):
        m = _HEREDOC.search(lines[i])
        if m is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and (lines[end].lstrip("\t") if m.group(1) else lines[end]).rstrip() != m.group(3):
            end += 1
        body = "\n".join(lines[i + 1:end]) + "\n"
        target = _WRITES.match(lines[i].replace(m.group(0), " "))
        if target:
            files[target.group(1).strip("'\"")] = body
        lines[i] = lines[i].replace(m.group(0), " ")
        for j in range(i + 1, min(end + 1, len(lines))):
            lines[j] = ""
        i = end + 1
    return "\n".join(lines), files


def parse_script(text: str, env: dict[str, str] | None = None,
                 files: dict[str, str] | None = None) -> list[ShellCommand]:
    """Every simple command of the script, in order, with the exported environment each one sees. Here-documents
    the script writes to files are added to `files`; `alias` definitions are expanded like bash does."""
    shell_vars: dict[str, str] = dict(env or {})
    exported: dict[str, str] = dict(env or {})
    aliases: dict[str, list[str]] = {}
    out: list[ShellCommand] = []
    text, written = heredocs(_PROMPT.sub("", text))
    if files is not None:
        files.update(written)
    for line, logical in _logical_lines(text):
        for words in _split(logical):
            while words and words[0] in _KEYWORDS:
                words = words[1:]
            if not words or words[0] in _ENDERS:
                continue
            if words[0] == "alias":
                for definition in words[1:]:
                    name, eq, value = definition.partition("=")
                    if eq:
                        aliases[name] = shlex.split(value.replace(QUOTED_DOLLAR, "$"))
                continue
            if words[0] in aliases:
                words = aliases[words[0]] + words[1:]
            missing: list[str] = []
            prefix: dict[str, str] = {}
            while words and (m := _ASSIGN.match(words[0])):
                prefix[m.group(1)] = "".join(_expand(m.group(2), shell_vars, missing))
                words = words[1:]
            if not words:  # plain assignments: shell variables (exported if already exported)
                shell_vars.update(prefix)
                exported.update({k: v for k, v in prefix.items() if k in exported})
                continue
            if words[0] in ("export", "declare", "typeset", "local", "readonly"):
                for w in words[1:]:
                    if w.startswith("-"):
                        continue
                    name, eq, value = w.partition("=")
                    value = "".join(_expand(value, shell_vars, missing)) if eq else shell_vars.get(name, "")
                    if eq or name in shell_vars:
                        shell_vars[name] = value
                        if words[0] == "export" or words[1:2] == ["-x"]:
                            exported[name] = value
                continue
            argv: list[str] = []
            for w in words:
                argv.extend(_expand(w, shell_vars, missing))
            out.append(ShellCommand(tuple(argv), tuple({**exported, **prefix}.items()), line,
                                    tuple(dict.fromkeys(missing))))
    return out
