"""Generated files must match the code: schemas/appliance.schema.json, docs/parameters.md, packaged recipes."""
from __future__ import annotations

import json
from pathlib import Path

from appliance.config import ApplianceConfig
from appliance.config.docs import REPO_ROOT, generated_files, json_schema_text, parameters_markdown
from appliance.config.flags import flag_specs


def test_generated_files_are_up_to_date() -> None:
    stale = [str(rel) for rel, text in generated_files().items()
             if not (REPO_ROOT / rel).exists() or (REPO_ROOT / rel).read_text() != text]
    assert stale == [], f"out of date, run `appliance schema`: {stale}"


def test_packaged_recipes_mirror_the_repository() -> None:
    recipes = sorted(p.name for p in (REPO_ROOT / "recipes").glob("*.toml"))
    packaged = sorted(p.name for p in (REPO_ROOT / "appliance" / "recipes").glob("*.toml"))
    assert recipes == packaged and "default.toml" in recipes


def test_schema_and_docs_cover_every_key_and_flag() -> None:
    schema = json.loads(json_schema_text())
    docs = parameters_markdown()
    for section, info in ApplianceConfig.model_fields.items():
        assert section in schema["properties"]
        assert f"## [{section}]" in docs
        for key, field in info.annotation.model_fields.items():  # type: ignore[union-attr]
            assert f"| `{key}` |" in docs
            assert field.description, f"{section}.{key} has no description"
    for spec in flag_specs():
        assert f"`{spec.names[0]}" in docs


def test_json_schema_validates_recipes_keys() -> None:
    # The editor schema forbids unknown keys like the loader does.
    schema = json.loads(json_schema_text())
    assert schema["additionalProperties"] is False
    assert Path(REPO_ROOT / "schemas" / "appliance.schema.json").exists()
