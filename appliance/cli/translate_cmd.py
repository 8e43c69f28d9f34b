"""`appliance translate`: a vLLM / SGLang / TokenSpeed / Atlas launch command -> appliance TOML, and back.

Exit codes: 0 translated, 1 unmapped flags under --strict, 2 unreadable input.
"""
from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path
from typing import Any

from appliance.translate import schema_view
from appliance.translate.emit import to_toml
from appliance.translate.result import Translation
from appliance.translate.reverse import to_command
from appliance.translate.translator import TranslateError, translate_text

EXIT_OK, EXIT_UNMAPPED, EXIT_UNREADABLE = 0, 1, 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "translate", help="translate a vLLM / SGLang / TokenSpeed / Atlas launch command into appliance TOML",
        description="Read a shell script or a pasted launch command (FILE, or - for stdin) and write the "
        "equivalent appliance TOML. With --to, read an appliance TOML file and print the equivalent vLLM or "
        "SGLang command instead.")
    configure(p)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="FILE", help="script or command file; - reads standard input")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of standard output (a script "
                   "with several engine commands writes FILE-node<rank>.toml, one per command)")
    p.add_argument("--strict", action="store_true", help="fail (exit 1) when any flag has no equivalent")
    p.add_argument("--to", choices=("vllm", "sglang"), help="reverse: FILE is appliance TOML; print the "
                   "equivalent command for this engine")


def _read(name: str) -> tuple[str, Path | None]:
    if name == "-":
        return sys.stdin.read(), None
    path = Path(name)
    return path.read_text(encoding="utf-8"), path.resolve().parent


def _write(text: str, dest: str | None) -> None:
    if dest is None:
        sys.stdout.write(text)
    else:
        Path(dest).write_text(text, encoding="utf-8")


def _document(name: str) -> dict[str, Any]:
    """The config as the appliance resolves it (`extends` included, defaults left out), with the file's own
    `${oc.env:VAR}` values kept as written: the engine command reads the same variables."""
    from appliance.config.interpolation import MARK
    from appliance.config.loader import resolve
    from appliance.config.sources import read_document

    config = resolve(name, env={}, run_env=False).config
    document = config.model_dump(mode="json", exclude_defaults=True)

    def keep(raw: dict[str, Any], out: dict[str, Any]) -> None:
        for key, value in raw.items():
            if isinstance(value, dict):
                keep(value, out.setdefault(key, {}))
            elif isinstance(value, str) and MARK in value:
                out[key] = value

    keep(read_document(Path(name)).data, document)
    return document


def _reverse(args: argparse.Namespace) -> int:
    """The config as the appliance resolves it (`extends` included, defaults left out) -> an engine command."""
    from appliance.config import ConfigError

    try:
        if args.input == "-":
            document = tomllib.loads(sys.stdin.read())
            problems = schema_view.validate(document)
            if problems:
                raise ValueError("; ".join(problems))
        else:
            document = _document(args.input)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ConfigError, ValueError) as exc:
        print(f"error: cannot read {args.input} as an appliance config: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    command = to_command(document, args.to)
    for path, value in command.inexpressible.items():
        print(f"warning: {path} = {value!r} has no {args.to} equivalent", file=sys.stderr)
    if args.strict and command.inexpressible:
        print(f"error: {len(command.inexpressible)} settings have no {args.to} equivalent (--strict)",
              file=sys.stderr)
        return EXIT_UNMAPPED
    _write(command.render(), args.output)
    return EXIT_OK


def _outputs(translations: list[Translation], dest: str | None) -> list[str | None]:
    if dest is None or len(translations) == 1:
        return [dest] * len(translations)
    ranks = [t.get("parallelism.node_rank", 0) for t in translations]
    labels = [f"node{r}" for r in ranks] if len(set(map(str, ranks))) == len(ranks) and None not in ranks \
        else [str(i) for i in range(len(translations))]
    base = Path(dest)
    return [str(base.with_name(f"{base.stem}-{label}{base.suffix or '.toml'}")) for label in labels]


def main(args: argparse.Namespace) -> int:
    if args.to:
        return _reverse(args)
    origin = "stdin" if args.input == "-" else args.input
    try:
        text, base_dir = _read(args.input)
        result = translate_text(text, base_dir)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: cannot read {origin}: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    except TranslateError as exc:
        print(f"error: {origin}: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    for skipped in result.skipped:
        print(f"note: {origin}: {skipped}: not an engine launch command, skipped", file=sys.stderr)
    unmapped = 0
    for tr in result.translations:
        for f in tr.findings:
            if f.level == "warning":
                print(f"warning: {origin}:{tr.line}: {f.subject}: {f.message}", file=sys.stderr)
        for message in tr.unsupported:
            print(f"note: {origin}:{tr.line}: not available in this build yet: {message}", file=sys.stderr)
        for problem in tr.problems:
            print(f"warning: {origin}:{tr.line}: the result does not validate: {problem}", file=sys.stderr)
        unmapped += len(tr.unmapped)
    if args.strict and unmapped:
        print(f"error: {unmapped} flag(s) have no equivalent (--strict); nothing written", file=sys.stderr)
        return EXIT_UNMAPPED
    docs = [to_toml(tr, origin) for tr in result.translations]
    dests = _outputs(result.translations, args.output)
    if args.output is None and len(docs) > 1:
        sep = "\n# " + "=" * 100 + "\n"
        docs = [f"# command {i + 1} of {len(docs)}: one file per node (use -o to write them separately)\n{d}"
                for i, d in enumerate(docs)]
        _write(sep.join(docs), None)
        return EXIT_OK
    for doc, dest in zip(docs, dests):
        _write(doc, dest)
        if dest is not None:
            print(f"wrote {dest}", file=sys.stderr)
    return EXIT_OK


def run(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m appliance.cli.translate_cmd`), used by tests."""
    parser = argparse.ArgumentParser(prog="appliance translate")
    configure(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(run())
