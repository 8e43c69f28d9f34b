"""Regenerate schemas/appliance.schema.json, docs/parameters.md and the packaged recipes
(same as `appliance schema`; `--check` only reports drift)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from appliance.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["schema", *sys.argv[1:]]))
