"""Regenerate schemas/appliance.schema.json, docs/parameters.md and the packaged recipes
(same as `appliance schema`; `--check` only reports drift): `python -m tools.gen_docs [--check]`."""
from __future__ import annotations

import sys

from appliance.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["schema", *sys.argv[1:]]))
