"""Resolving a model path or repo id to a local directory, through the local Hugging Face cache only.

No torch import: the tokenizer process and the executor both use it. Nothing here touches the network.
"""
from __future__ import annotations

import os
import re
from pathlib import Path


class ModelNotFound(FileNotFoundError):
    pass


def hf_cache_dir(download_dir: str | None) -> Path:
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def resolve_model_dir(path: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """`path` itself when it is a directory, else the snapshot of repo id `path` at `revision` in the HF cache."""
    local = Path(path).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ValueError(f"revision {revision!r} was given but {path} is a local directory, which has none")
        return local
    cache = hf_cache_dir(download_dir)
    repo_dir = cache / ("models--" + path.replace("/", "--"))
    if not repo_dir.is_dir():
        raise ModelNotFound(f"model {path!r} is not a local directory and is not in the Hugging Face cache "
                            f"(looked for {repo_dir}); download it first, downloads are never made at load time")
    rev = revision or "main"
    snapshot = repo_dir / "snapshots" / rev
    if not (re.fullmatch(r"[0-9a-f]{40}", rev) and snapshot.is_dir()):
        ref = repo_dir / "refs" / rev
        if not ref.is_file():
            raise ModelNotFound(f"revision {rev!r} of {path!r} is not in the local cache (no {ref})")
        snapshot = repo_dir / "snapshots" / ref.read_text().strip()
    if not (snapshot / "config.json").is_file() and not (snapshot / "tokenizer_config.json").is_file():
        raise ModelNotFound(f"cached snapshot {snapshot} of {path!r} has neither config.json nor a tokenizer")
    return snapshot
