"""The persistent compile cache: where Triton's compiled kernels (and torch inductor's artefacts) are kept between
runs, `cache.compile_cache_dir`.

A fresh machine compiles every Triton specialisation the warm-up meets (executor/warmup.py); a machine that has
run the same model and build before loads them from this cache instead. Triton reads TRITON_CACHE_DIR when it
compiles, so each process points it (and TORCHINDUCTOR_CACHE_DIR) here before the first kernel: every pipeline
stage at its start (runtime/stage.py) and the offline LLM. The config decides: a TRITON_CACHE_DIR already in the
environment is replaced (logged). Mount this directory on a persistent volume to keep replicas' starts warm.
Its `kernels/` holds the lists of Triton variants each configuration's start compiled, which a later start compiles
ahead in parallel where the file cache misses (executor/compile_ahead.py).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}  # variable -> subdirectory


def use_compile_cache(cache_dir: str) -> dict[str, str]:
    """Point this process' (and its children's) compile caches under cache_dir, creating the directories; returns
    the variables set. A directory that cannot be created is an error naming the setting."""
    root = Path(cache_dir).expanduser()
    set_now: dict[str, str] = {}
    for var, sub in CACHE_ENV.items():
        path = root / sub
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cache.compile_cache_dir {cache_dir!r}: cannot create {path}: "
                             f"{exc.strerror or exc}") from None
        if not os.access(path, os.W_OK):
            raise ValueError(f"cache.compile_cache_dir {cache_dir!r}: {path} is not writable")
        previous = os.environ.get(var)
        if previous is not None and previous != str(path):
            log.info("%s=%s replaced by cache.compile_cache_dir: %s", var, previous, path)
        os.environ[var] = set_now[var] = str(path)
    log.info("compile cache: %s", ", ".join(f"{k}={v}" for k, v in set_now.items()))
    return set_now
