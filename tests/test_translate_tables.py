"""The flag tables are checked against each engine's real flag list and against the config schema; the
generated docs/translation.md must match them."""
from __future__ import annotations

from pathlib import Path

import pytest

from appliance.translate import docgen, schema_view
from appliance.translate.argv import ArgvReader
from appliance.translate.tables import TABLES

FIXTURES = Path(__file__).parent / "fixtures" / "translate"
# most commonly used flags per engine (recipes, quick starts): each must map to a setting, not just be listed
COMMON = {
    "vllm": ["--model", "--tensor-parallel-size", "-tp", "--data-parallel-size", "--enable-expert-parallel",
             "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens",
             "--enable-prefix-caching", "--kv-cache-dtype", "--dtype", "--quantization", "--trust-remote-code",
             "--served-model-name", "--host", "--port", "--api-key", "--speculative-config",
             "--tool-call-parser", "--reasoning-parser", "--enforce-eager", "--block-size", "--chat-template"],
    "sglang": ["--model-path", "--tp-size", "--dp-size", "--ep-size", "--mem-fraction-static", "--context-length",
               "--page-size", "--max-running-requests", "--chunked-prefill-size", "--max-total-tokens",
               "--trust-remote-code", "--host", "--port", "--attention-backend", "--speculative-algorithm",
               "--cuda-graph-max-bs", "--disable-radix-cache", "--dist-init-addr", "--nnodes", "--node-rank",
               "--reasoning-parser", "--tool-call-parser", "--kv-cache-dtype", "--quantization"],
}


def reference(name: str) -> list[list[str]]:
    lines = (FIXTURES / f"{name}_flags.txt").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("engine", list(TABLES))
def test_every_real_flag_has_a_row(engine: str) -> None:
    table = TABLES[engine]
    reader = ArgvReader(table, allow_abbrev=False)
    missing = [names[0] for names in reference(engine) for n in names if reader.resolve(n)[0] is None
               and not any(n.startswith(prefix) for prefix, _ in table.families)]
    assert missing == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_aliases_match_the_engine(engine: str) -> None:
    lookup = TABLES[engine].lookup
    for names in reference(engine):
        flags = {id(lookup[n]) for n in names if n in lookup}
        assert len(flags) <= 1, f"{names} are one option in {engine} but different rows here"


@pytest.mark.parametrize("engine", list(COMMON))
def test_common_flags_are_mapped(engine: str) -> None:
    lookup = TABLES[engine].lookup
    assert [f for f in COMMON[engine] if not lookup[f].mapped] == []


@pytest.mark.parametrize("engine", list(TABLES))
def test_targets_exist_in_the_schema(engine: str) -> None:
    for flag in TABLES[engine].flags:
        targets = [t for _, t in flag.subkeys if t != "-"] if flag.subkeys else [flag.target]
        for target in targets:
            if target is None or target.startswith("@"):
                continue
            assert schema_view.key_info(target) is not None, f"{flag.canonical} -> {target}"


@pytest.mark.parametrize("engine", list(TABLES))
def test_rows_are_explained(engine: str) -> None:
    for flag in TABLES[engine].flags:
        if flag.status != "same":
            assert flag.note, f"{flag.canonical} ({flag.status}) needs a note"
        if flag.status in ("same", "similar"):
            assert flag.target is not None, flag.canonical
        for value in (v for _, v in flag.values if isinstance(v, str)):
            info = schema_view.key_info(flag.target or "")
            if info is not None and info.choices and not flag.subkeys:
                assert value in info.choices, f"{flag.canonical}: {value} not allowed by {flag.target}"


def test_engine_defaults_are_valid_settings() -> None:
    for table in TABLES.values():
        for path, value, why in table.defaults:
            assert schema_view.key_info(path) is not None and why
            assert schema_view.validate({path.split(".")[0]: {path.split(".")[1]: value}}) == []


def test_translation_doc_is_generated_from_the_tables() -> None:
    assert docgen.DOC.read_text() == docgen.render(), "run `python -m appliance.translate.docgen`"


def test_doc_lists_every_flag() -> None:
    text = docgen.render()
    for table in TABLES.values():
        for flag in table.flags:
            assert f"`{flag.canonical}`" in text
