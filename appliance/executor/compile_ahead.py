"""Triton kernels compiled ahead, in parallel, while the weights load: the variants an earlier start of the same
configuration compiled, kept as a list beside the compile cache (executor/compile_cache.py).

A start compiles each Triton specialisation its warm-up meets one after another on the worker's thread, most of
the time in LLVM and ptxas: the 8B shape's warm-up spent ~15 s compiling prefill variants and much of its decode
graph capture compiling the rest. Every start on a GPU records the variants it compiled (Triton's
jit_post_compile_hook gives each one's specialisation data, the same record `JITFunction.preload` reads) into
`<compile_cache_dir>/kernels/<fingerprint>.json`, keyed by what decides the variants: the model's layer shapes,
the settings that pick kernels, the GPU target and the Triton version. A later start of the same key
compiles that list in `cache.compile_workers` processes from its first phases on, writing Triton's file cache;
the warm-up then loads from there each kernel the pool has compiled by the time it gets to it. That pays where the
file cache misses but the list is still right: a fresh cache directory given the list, a new build whose kernel
sources changed (their cache keys change, their variants do not), a fresh machine where the build ships the list
for its model in appliance/kernels/ahead/ (a copy of a list an earlier start wrote: our own kernels' variant records,
no binaries). A listed variant that no longer exists is skipped; one the list lacks is compiled by the warm-up as
before, so the list can only save time, never change what runs.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from appliance.config.schema import ApplianceConfig

log = logging.getLogger(__name__)

# what decides a model's kernel variants: its layer shapes, not its depth, context length or ids
MODEL_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_local_experts",
              "num_experts", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank",
              "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "sliding_window", "layer_types",
              "quantization_config")
SETTINGS = ("precision", "backends", "parallelism", "speculative")  # the sections that pick kernels
Record = dict[str, Any]  # a listed variant: module, name, spec (Triton's specialisation data), target
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "kernels" / "ahead"  # lists shipped with the build


def fingerprint(config: dict[str, Any], model_config: dict[str, Any], target: str, triton_version: str) -> str:
    """The key of a list: the model's layer shapes (MODEL_KEYS of its config.json), the settings that pick kernels
    (SETTINGS), the GPU target and Triton's version. Coarse on purpose: starts that differ elsewhere (batch sizes,
    context, step budget) share one list, the union of what each met; a variant one of them never meets costs a
    pool process' time, never a wrong kernel."""
    shape = {k: model_config[k] for k in MODEL_KEYS if k in model_config}
    blob = json.dumps([shape, {k: config.get(k) for k in SETTINGS}, target, triton_version], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def manifest_path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / "kernels" / f"{key}.json"


def read_manifest(path: Path) -> list[Record]:
    """The listed variants; an unreadable list is an empty one (logged)."""
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())["variants"]
        return [e for e in entries if isinstance(e, dict) and {"module", "name", "spec"} <= e.keys()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("compile-ahead list %s unreadable (%s): the warm-up compiles as it goes", path, exc)
        return []


def write_manifest(path: Path, entries: list[Record]) -> None:
    """Atomically (ranks of one replica write the same list)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"variants": entries}))
    os.replace(tmp, path)


class CompiledVariants:
    """Records every Triton variant this process compiles (installed as jit_post_compile_hook, chained to any
    hook already there)."""

    def __init__(self, target: dict[str, Any]) -> None:
        self.target = target  # the GPU's, kept with each record
        self.entries: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._previous: Callable[..., Any] | None = None

    def install(self) -> None:
        from triton import knobs

        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self

    def uninstall(self) -> None:
        from triton import knobs

        if knobs.runtime.jit_post_compile_hook is self:
            knobs.runtime.jit_post_compile_hook = self._previous

    def __call__(self, *, key: Any, repr: str, fn: Any, compile: dict[str, Any], is_manual_warmup: bool,
                 already_compiled: bool) -> bool | None:
        spec = compile["specialization_data"]
        self.entries.setdefault((fn.module, fn.name, spec),
                                {"module": fn.module, "name": fn.name, "spec": spec, "target": self.target})
        if self._previous is not None:
            return self._previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                  already_compiled=already_compiled)
        return None


def compile_variants(entries: list[Record]) -> int:
    """Compile these variants into Triton's file cache (TRITON_CACHE_DIR), as `JITFunction.preload` does but
    without a device: the target comes with each record. Runs in a pool process; returns how many compiled (a
    variant whose kernel or parameters changed since it was listed is skipped)."""
    done = 0
    for entry in entries:
        try:
            _compile_one(entry)
            done += 1
        except Exception as exc:  # noqa: BLE001 - a stale record costs only its compile, never the start
            log.debug("compile-ahead skipped %s.%s: %s", entry.get("module"), entry.get("name"), exc)
    return done


def _compile_one(entry: Record) -> None:
    import triton

    src, target, options = source_of(entry)
    triton.compile(src, target=target, options=options.__dict__)


def source_of(entry: Record) -> tuple[Any, Any, Any]:
    """(ASTSource, GPUTarget, backend options) of a record, as the JIT built them: the same cache key."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    data = json.loads(entry["spec"])
    fn = _resolve(entry["module"], entry["name"])
    target = GPUTarget(**(data.get("target") or entry["target"]))  # older Tritons' records lack theirs
    constexprs = {tuple(k): _constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}  # lists, as parse_attr gives
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    options = make_backend(target).parse_options({k: _tuples(v) for k, v in data["options"].items()})
    return ASTSource(fn, signature, constexprs, attrs), target, options


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "cache_key") and hasattr(obj, "fn"):  # an autotuner / heuristics wraps its JITFunction
        obj = obj.fn
    return obj


def _constant(value: Any) -> Any:
    import triton.language as tl

    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(_tuples(value["constexpr"]))
    if isinstance(value, dict) and "jit_function" in value:
        module, _, qualname = value["jit_function"].partition(":")
        return _resolve(module, qualname)
    return _tuples(value)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def default_workers(cpus: int | None = None) -> int:
    """cache.compile_workers unset: half the CPU cores, at most 8."""
    return max(1, min(8, (cpus or os.cpu_count() or 2) // 2))


def begin(config: ApplianceConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
          ) -> CompileAhead | None:
    """Start recording this start's compiles and compiling the variants listed for its configuration (its model
    running in `dtype`, the resolved precision.dtype); None off the GPU, under Triton's interpreter, or with
    cache.compile_workers = 0."""
    workers = config.cache.compile_workers
    workers = default_workers() if workers is None else workers
    if device.type != "cuda" or workers == 0 or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    import triton
    from triton.runtime import driver

    knobs = getattr(triton, "knobs", None)
    if not hasattr(getattr(knobs, "runtime", None), "jit_post_compile_hook"):
        log.info("Triton %s has no compile hook to list variants with: no kernels compiled ahead",
                 triton.__version__)
        return None
    try:
        target = driver.active.get_current_target()
    except Exception as exc:  # noqa: BLE001 - a start without the list only compiles as it goes
        log.warning("no kernels compiled ahead: Triton names no GPU target here (%s)", exc)
        return None
    settings = config.model_dump(mode="json")
    settings["precision"]["dtype"] = str(dtype)  # `auto` and the dtype it resolves to share a list
    config_json = model_dir / "config.json"
    key = fingerprint(settings, json.loads(config_json.read_text()) if config_json.is_file() else {},
                      f"{target.backend}:{target.arch}:{target.warp_size}", triton.__version__)
    path = manifest_path(config.cache.compile_cache_dir, key)
    return CompileAhead(path, read_manifest(path) or read_manifest(SHIPPED_DIR / path.name), workers,
                        {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size})


@dataclass(frozen=True)
class AheadReport:
    listed: int  # variants listed now (the earlier list and those this start met)
    compiled: int  # listed variants the pool's finished processes compiled (or found cached)
    stopped: int  # pool processes stopped unfinished


class CompileAhead:
    """One start's recorder and pool: made by `begin` (before the model is built, so the pool runs while the weights
    load and memory is profiled) and ended by `finish` (once the warm-up has met every variant it needs).
    Nothing waits for the pool: the warm-up compiles or loads each variant as before, and finds in the cache those
    the pool, running ahead in list order on several processes, has compiled by then; so the list only ever saves
    time, and a warm cache costs no wait. The pool is plain `python -m appliance.executor.compile_ahead` processes
    reading their share of the list on stdin, not multiprocessing's: a spawned child would re-run an offline
    script's unguarded top level (its LLM)."""

    def __init__(self, path: Path, listed: list[Record], workers: int, target: dict[str, Any]) -> None:
        self.path, self.listed = path, listed
        self.recorder = CompiledVariants(target)
        self.recorder.install()
        self.procs: list[subprocess.Popen[str]] = []
        for i in range(min(workers, len(listed))):
            try:
                self.procs.append(self._spawn(listed[i::workers]))
            except OSError as exc:  # the warm-up compiles that share as it goes
                log.warning("a compile-ahead process did not start (%s)", exc)
                break
        if self.procs:
            log.info("compiling %d listed Triton variants ahead in %d processes (%s)", len(listed), len(self.procs),
                     path)
        weakref.finalize(self, _stop, list(self.procs))  # a start that fails before finish() leaves none running

    @staticmethod
    def _spawn(shard: list[Record]) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(shard))
        proc.stdin.close()
        return proc

    def finish(self, wait: bool = False) -> AheadReport:
        """Stop the pool (its processes still compiling are no longer needed: the warm-up is through; `wait`: let
        them finish, for tests), stop recording, and write the listed variants with those this start met."""
        compiled, stopped = 0, 0
        for proc in self.procs:
            if not wait and proc.poll() is None:
                proc.terminate()
                stopped += 1
            assert proc.stdout is not None
            out = proc.stdout.read()  # its stdin is already closed: no communicate()
            proc.stdout.close()
            proc.wait()
            last = out.strip().splitlines()[-1:] or [""]
            compiled += int(last[0]) if proc.returncode == 0 and last[0].isdigit() else 0
        if self.procs:
            log.info("compile ahead: %d of %d listed Triton variants compiled by %d processes (%d stopped unfinished: "
                     "the warm-up needed them no longer)", compiled, len(self.listed), len(self.procs), stopped)
        self.procs = []
        self.recorder.uninstall()
        merged = {(e["module"], e["name"], e["spec"]): e for e in self.listed}
        merged.update(self.recorder.entries)
        entries = list(merged.values())
        if len(entries) > len(self.listed):
            try:
                write_manifest(self.path, entries)
            except OSError as exc:
                log.warning("compile-ahead list %s not written: %s", self.path, exc)
        return AheadReport(len(entries), compiled, stopped)


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":  # a pool process: its share of the list on stdin, the count compiled on stdout
    print(compile_variants(json.loads(sys.stdin.read())))
