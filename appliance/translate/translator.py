"""Script text -> one Translation per engine command it launches (several for multi-node scripts)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from appliance.translate import rules, schema_view
from appliance.translate.apply import Applier
from appliance.translate.argv import ArgvReader, FlagUse, config_file_words
from appliance.translate.launcher import Launch, detect
from appliance.translate.result import Translation
from appliance.translate.shell import ShellCommand, ShellSyntaxError, parse_script, restore, unresolved_refs
from appliance.translate.spec import EngineTable, Flag, same
from appliance.translate.tables import TABLES

POSITIONAL_MODEL = same("MODEL", "model.path", "Model")  # engines whose model is only positional (Atlas)
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL", re.I)
_MAX_DEPTH = 4


class TranslateError(ValueError):
    """The input cannot be read as a launch command (exit code 2)."""


@dataclass
class ScriptResult:
    translations: list[Translation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # other commands of the script, for the report


def translate_text(text: str, base_dir: Path | None = None) -> ScriptResult:
    files: dict[str, str] = {}  # files the script writes itself (here-documents): --config may name one
    try:
        commands = parse_script(text, files=files)
    except ShellSyntaxError as exc:
        raise TranslateError(f"cannot read the input as a shell command: {exc}") from exc
    result = ScriptResult()
    for cmd in commands:
        _walk(cmd, result, base_dir, 0, files)
    if not result.translations:
        seen = "; ".join(result.skipped[:5]) or "nothing"
        raise TranslateError(f"no vLLM, SGLang, TokenSpeed or Atlas launch command found (saw: {seen})")
    return result


def _walk(cmd: ShellCommand, result: ScriptResult, base_dir: Path | None, depth: int,
          files: dict[str, str]) -> None:
    env = dict(cmd.env)
    launch = detect(cmd.argv, env)
    if launch.script is not None and depth < _MAX_DEPTH:
        for inner in parse_script(launch.script, env, files):
            _walk(ShellCommand(inner.argv, inner.env, cmd.line, inner.unresolved), result, base_dir, depth + 1,
                  files)
        return
    if launch.engine is None:
        result.skipped.append(f"line {cmd.line}: {restore(' '.join(cmd.argv[:3]))}")
        return
    result.translations.append(translate_launch(launch, {**env, **launch.env}, cmd, base_dir, files))


def translate_launch(launch: Launch, env: dict[str, str], cmd: ShellCommand, base_dir: Path | None,
                     files: dict[str, str] | None = None) -> Translation:
    assert launch.engine is not None
    table = TABLES[launch.engine]
    out = Translation(launch.engine, table.title, cmd.line, [restore(w) for w in cmd.argv])
    reader = ArgvReader(table, allow_abbrev=launch.engine != "atlas")  # clap (Atlas) has no abbreviations
    cli_uses, positionals = reader.read(launch.args)
    model_flag = table.lookup.get("--model") or table.lookup.get("--model-path") or POSITIONAL_MODEL
    for i, word in enumerate(positionals):
        if i == 0 and launch.positional_model and model_flag is not None:
            cli_uses.insert(0, FlagUse(model_flag, "MODEL", word))
        else:
            out.warn(restore(word), f"unexpected positional argument for {table.title}; not translated",
                     unmapped=True)
    # lowest to highest: engine environment variables, --config file, command line
    uses = _env_uses(table.env_flags, env, table.lookup) \
        + _config_file_uses(reader, cli_uses, base_dir, out, files or {}) + cli_uses
    applier = Applier(out)
    for use in uses:
        applier.apply(use)
    rules.finish(out, applier, uses, table, env, launch.devices)
    _report_env(out, env, table)
    out.context[:0] = [f"docker: {line}" for line in launch.docker]
    out.problems = schema_view.validate(out.document())
    out.unsupported = schema_view.unsupported(out.document())
    return out


def _config_file_uses(reader: ArgvReader, uses: list[FlagUse], base_dir: Path | None,
                      out: Translation, files: dict[str, str]) -> list[FlagUse]:
    """Uses read from `--config FILE.yaml` (a file on disk, or one the script writes with a here-document), to be
    applied before the command line's own."""
    found: list[FlagUse] = []
    for use in uses:
        if use.flag is None or use.flag.canonical != "--config" or not isinstance(use.value, str):
            continue
        name = restore(use.value)
        if unresolved_refs(use.value):
            out.warn(use.display, "the config file path is unresolved; its settings are not translated",
                     unmapped=True)
            continue
        path = Path(name)
        candidates = [path] if path.is_absolute() or base_dir is None else [base_dir / path, path]
        target = next((p for p in candidates if p.is_file()), None)
        inline = files.get(name, files.get(path.name)) if target is None else None
        if target is None and inline is None:
            out.warn(use.display, f"config file {name} not found; its settings are not translated", unmapped=True)
            continue
        try:
            words = config_file_words(inline if inline is not None else target.read_text(), name)
            file_uses, extra = reader.read(words, origin=name)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            out.warn(use.display, f"cannot read {name}: {exc}", unmapped=True)
            continue
        found.extend(file_uses)
        for word in extra:
            out.warn(word, f"unexpected value in {name}; not translated", unmapped=True)
        out.note(use.display, f"settings of {name} translated; command-line flags override them")
    return found


def _env_uses(env_flags: tuple[tuple[str, str], ...], env: dict[str, str],
              lookup: dict[str, Flag]) -> list[FlagUse]:
    return [FlagUse(lookup[flag], f"{name}=", env[name], origin="environment")
            for name, flag in env_flags if name in env and flag in lookup]


def _report_env(out: Translation, env: dict[str, str], table: EngineTable) -> None:
    used = {name for name, _ in table.env_flags} | {"CUDA_VISIBLE_DEVICES"}
    for name, value in env.items():
        if name in used:
            continue
        if _SECRET.search(name):
            out.context.append(f"environment {name} is a secret: not copied; set it where the appliance starts")
        elif unresolved_refs(value):
            out.context.append(f"environment {name} comes from the host ({restore(value)}); keep it set")
        else:
            out.context.append(f"environment {name}={restore(value)} is not a config setting; keep it in the "
                               "environment")
