"""The engine's own settings: a small frozen record, built from the appliance config or by hand in tests."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig
    from appliance.config.sections_engine import CacheSection, SchedulerSection

from appliance.engine.host_tier import WRITE_POLICIES
from appliance.engine.kv_groups import KVGroup
from appliance.engine.speculation import drafter_reads_next_token, lookahead_tokens, tree_scratch_tokens
from appliance.engine.swap import PREEMPTION_MODES, SwapCosts

POLICIES = ("fcfs", "lpm", "slo")
# scheduler.max_mixed_prefill_tokens unset under `appliance serve`: a mixed step's prefill share. On an H100 a
# 2048-token chunk of an 8B model already runs its GEMMs compute-bound, so a burst of prompts costs about the same
# device time in 2048-token pieces as in 8192-token ones, while the decodes beside them wait a quarter as long.
# Twice what a closed loop of 256 streams of 1024 in / 256 out needs per step (1024), so prefill keeps up.
SERVING_MIXED_PREFILL_TOKENS = 2048

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """What the scheduler, block pool and prefix cache need to know.

    chunked_prefill_size is the token budget of one step (decodes and prefill chunks together); -1 disables
    chunking: a prompt is then prefilled whole, prefills of one step share max_prefill_tokens, and a prompt
    longer than max_prefill_tokens runs alone in its step rather than never. When more requests decode than
    the budget holds, they take turns (least recently scheduled first).

    max_mixed_prefill_tokens bounds the prefill tokens of a step that also decodes (None: the budget left after
    the decodes); a step without decodes takes the whole budget. Needs chunking.

    schedule_conservativeness > 0 makes admission reserve room for the running requests' outputs (SGLang's
    new_token_ratio, see admission.py); 0 admits while the blocks of the next chunk are free.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 8192
    max_mixed_prefill_tokens: int | None = None
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    max_queued_requests: int | None = None
    policy: str = "fcfs"
    slo_tbt_ms: float = 100.0  # policy slo: the time-between-tokens deadline (slo.py)
    lpm_scan_limit: int = 128  # lpm compares at most this many waiting requests per admission
    # speculative decoding: drafts the workers propose after every sample, verified in the next step; 0 = off
    num_speculative_tokens: int = 0
    # above this many decoding requests a step verifies no drafts (speculative.disable_by_batch_size); None: never
    spec_disable_batch_size: int | None = None
    # positions past a sampling chunk the drafter's cache takes (speculation.lookahead_tokens); None: k - 1 (MTP)
    spec_lookahead: int | None = None
    # the drafter's cache at a hit's last position saw the next token (speculation.drafter_reads_next_token)
    spec_drafter_reads_next: bool = False
    schedule_conservativeness: float = 0.0
    num_host_blocks: int = 0  # the host tier's slots (host_tier.py); 0: no host tier
    num_disk_blocks: int = 0  # the disk tier's slots behind it (disk_tier.py); 0: none
    # when device blocks are copied to the host tier: write_back when evicted, write_through once cached (the
    # copy leaves the step that evicts, an admission's: host_tier.py)
    host_cache_write_policy: str = "write_back"
    # what a preempted request keeps (swap.py): recompute | swap | auto; auto prices it with the workers' rates
    preemption_mode: str = "recompute"
    swap_costs: SwapCosts | None = None
    # hybrid models: request slots of the workers' state cache (executor/state_cache.py), one per running request;
    # 0 = the model keeps no recurrent state
    num_state_slots: int = 0
    state_cache_bytes: int = 0  # what the workers' state cache holds (each rank), for the metrics
    # prefix caching of hybrid models: state snapshots every ssm_checkpoint_interval tokens, in this many slots
    ssm_checkpoint_interval: int = 0
    ssm_snapshot_slots: int = 0
    # sliding-window KV cache groups (kv_groups.py, window_blocks.py): each sliding group's window and the blocks
    # of its pool (its null block included), or 0 for every group: they share the num_blocks pool (block 0 their
    # null block); empty: every layer keeps the whole context in the num_blocks pool
    window_sizes: tuple[int, ...] = ()
    window_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_prefill_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(
                f"EngineConfig.chunked_prefill_size must be positive or -1 (disabled), "
                f"got {self.chunked_prefill_size}"
            )
        mixed = self.max_mixed_prefill_tokens
        if mixed is not None and (mixed < 1 or not self.chunking):
            raise ValueError(f"EngineConfig.max_mixed_prefill_tokens must be >= 1 (None: no bound) and needs "
                             f"chunked prefill, got {mixed} with chunked_prefill_size {self.chunked_prefill_size}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"EngineConfig.max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.num_host_blocks < 0 or self.num_disk_blocks < 0:
            raise ValueError(f"EngineConfig.num_host_blocks / num_disk_blocks must be >= 0, got "
                             f"{self.num_host_blocks} / {self.num_disk_blocks}")
        if self.host_cache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"EngineConfig.host_cache_write_policy {self.host_cache_write_policy!r} is not one of "
                             f"{WRITE_POLICIES}")
        if self.num_disk_blocks and not self.num_host_blocks:
            raise ValueError("the disk tier sits behind the host tier: it needs num_host_blocks > 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"EngineConfig.preemption_mode {self.preemption_mode!r} is not one of {PREEMPTION_MODES}")
        if self.preemption_mode != "recompute":
            if not (self.num_host_blocks and self.enable_prefix_caching):
                raise ValueError(f"preemption mode {self.preemption_mode} swaps into the host tier, which this engine "
                                 "lacks (cache.host_cache with prefix caching)")
            if self.num_speculative_tokens or self.num_state_slots:
                raise ValueError(f"preemption mode {self.preemption_mode} is not supported with speculative decoding "
                                 "or a model with recurrent state (a swapped request's drafts and states are not "
                                 "kept); use recompute")
            if self.preemption_mode == "auto" and self.swap_costs is None:
                raise ValueError("preemption mode auto needs the workers' measured copy and prefill rates")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"EngineConfig.num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 0 <= self.schedule_conservativeness < float("inf"):  # NaN fails too
            raise ValueError(f"EngineConfig.schedule_conservativeness must be a finite number >= 0, "
                             f"got {self.schedule_conservativeness}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler policy {self.policy!r} is not implemented; the engine supports {POLICIES}")
        if self.policy == "slo" and not self.chunking:
            raise ValueError("scheduler policy slo sizes prefill chunks to the decodes' deadlines: it needs "
                             "chunked prefill (scheduler.chunked_prefill_size > 0)")
        if not self.slo_tbt_ms > 0:
            raise ValueError(f"EngineConfig.slo_tbt_ms must be > 0, got {self.slo_tbt_ms}")
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            # One sequence of max_model_len must fit alone, or it could preempt itself forever.
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of {self.block_size}), fewer "
                f"than max_model_len={self.max_model_len}; give the cache more memory or lower max_model_len"
            )

        self._check_windows()

    def _check_windows(self) -> None:
        object.__setattr__(self, "window_sizes", tuple(self.window_sizes))
        object.__setattr__(self, "window_blocks", tuple(self.window_blocks))
        if len(self.window_sizes) != len(self.window_blocks):
            raise ValueError(f"EngineConfig.window_sizes {self.window_sizes} and window_blocks {self.window_blocks} "
                             "must name the same groups")
        if not self.window_sizes:
            return
        other = [name for name, on in (("speculative decoding", self.num_speculative_tokens > 0),
                                       ("the host KV tier", self.num_host_blocks > 0),
                                       ("the disk KV tier", self.num_disk_blocks > 0),
                                       ("recurrent state", self.num_state_slots > 0)) if on]
        if other:
            raise ValueError(f"sliding-window KV cache groups do not work with {', '.join(other)} yet")
        if 0 in self.window_blocks and any(self.window_blocks):
            raise ValueError(f"EngineConfig.window_blocks {self.window_blocks}: either every sliding group shares "
                             "the full pool (0) or none does")
        shared_need = -(-self.max_model_len // self.block_size)  # the full group's, in a shared pool
        for w, n in zip(self.window_sizes, self.window_blocks):
            if w < 1:
                raise ValueError(f"EngineConfig.window_sizes: a window must be at least 1 token, got {w}")
            need = KVGroup(w, ()).blocks_held(self.max_model_len, self.block_size, self.step_tokens.largest_chunk)
            shared_need += need
            if n and n - 1 < need:  # one sequence must fit alone, as in the full pool
                raise ValueError(f"the sliding-window group of window {w} has {n - 1} blocks (and its null "
                                 f"block); one sequence of max_model_len={self.max_model_len} holds up to {need}")
        if self.window_shared and self.num_blocks - 1 < shared_need:
            raise ValueError(f"the KV pool the sliding-window groups share has {self.num_blocks - 1} blocks (and the "
                             f"null block); one sequence of max_model_len={self.max_model_len} holds up to "
                             f"{shared_need} in its groups")

    @property
    def window_shared(self) -> bool:
        """The sliding groups draw their blocks from the num_blocks pool (window_blocks all 0)."""
        return bool(self.window_blocks) and not any(self.window_blocks)

    @property
    def lookahead(self) -> int:
        return self.spec_lookahead if self.spec_lookahead is not None else max(0, self.num_speculative_tokens - 1)

    @property
    def chunking(self) -> bool:
        return self.chunked_prefill_size > 0

    @property
    def step_tokens(self) -> StepTokens:
        return StepTokens.of(self.chunked_prefill_size, self.max_prefill_tokens, self.max_model_len)

    @property
    def step_token_budget(self) -> int:
        return self.step_tokens.budget

    @classmethod
    def from_appliance(
        cls, config: ApplianceConfig, num_blocks: int, eos_token_ids: Iterable[int], max_model_len: int,
        num_host_blocks: int | None = None, num_state_slots: int = 0, state_cache_bytes: int = 0,
        swap_costs: SwapCosts | None = None, num_disk_blocks: int = 0,
        window_groups: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()), serving: bool = False,
    ) -> EngineConfig:
        """Read the appliance config's scheduler and cache sections.

        num_blocks (and window_groups: the sliding-window KV cache groups' windows and pool sizes, kv_groups.py)
        comes from the executor's memory profiling, eos_token_ids and max_model_len from the
        model (max_model_len already resolved against model.max_model_len by the caller). num_host_blocks: the
        host tier's slots the workers allocated (host_blocks); None: from host_cache_ratio alone. num_state_slots: the workers'
        state cache (hybrid models). A hybrid model's prefix cannot be reused from KV blocks alone (its
        linear-attention layers need the recurrent state at the end of the prefix), so without state snapshots
        (cache.ssm_checkpoint_interval) prefix caching is turned off for it, with a warning: the prefix is
        recomputed. num_disk_blocks: the disk tier's slots the workers' files hold (disk_blocks). swap_costs: the
        rates the workers measured for scheduler.preemption_mode auto (swap.py). serving: the scheduler process of
        `appliance serve` (the unset max_mixed_prefill_tokens differs there: mixed_prefill_tokens).
        """
        sched = config.scheduler
        cache = config.cache
        prefix_caching = cache.enable_prefix_caching
        # read only for hybrid models (stand-ins of the config in tests may lack the keys)
        interval = int(cache.ssm_checkpoint_interval or 0) if num_state_slots else 0
        if num_state_slots and prefix_caching and not interval:
            log.warning("prefix caching is off for this hybrid linear-attention model: reusing a prefix needs the "
                        "recurrent state at its end, and cache.ssm_checkpoint_interval is unset (no state "
                        "snapshots; the prefix is recomputed)")
            prefix_caching = False
        algorithm = getattr(getattr(config, "speculative", None), "algorithm", None)
        mode = str(getattr(sched, "preemption_mode", "recompute"))
        if mode == "auto" and swap_costs is not None:
            even = swap_costs.break_even_tokens(cache.block_size)
            log.info("preemption auto: a preempted request is swapped to the host tier when it has computed more "
                     "than %s tokens, else recomputed (measured: %.2f GB/s copies, %.0f prefill tokens/s)",
                     "no number of" if even is None else f"{even:.0f}", swap_costs.copy_gbps,
                     swap_costs.prefill_tok_s)
        return cls(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            max_num_seqs=sched.max_num_seqs,
            chunked_prefill_size=sched.chunked_prefill_size,
            max_prefill_tokens=sched.max_prefill_tokens,
            max_mixed_prefill_tokens=mixed_prefill_tokens(sched, serving),
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_caching,
            eos_token_ids=frozenset(eos_token_ids),
            max_queued_requests=sched.max_queued_requests,
            policy=sched.policy,
            slo_tbt_ms=float(getattr(sched, "slo_tbt_ms", 100.0)),
            num_speculative_tokens=num_speculative_tokens(config),
            spec_disable_batch_size=getattr(getattr(config, "speculative", None), "disable_by_batch_size", None),
            spec_lookahead=spec_lookahead(config),
            spec_drafter_reads_next=drafter_reads_next_token(algorithm) and num_speculative_tokens(config) > 0,
            # read like num_speculative_tokens: stand-ins of the config (tests) may lack the key; absent = 0
            schedule_conservativeness=float(getattr(sched, "schedule_conservativeness", 0.0)),
            num_host_blocks=host_blocks(cache, num_blocks) if num_host_blocks is None else num_host_blocks,
            host_cache_write_policy=getattr(cache, "host_cache_write_policy", None) or "write_back",
            num_state_slots=num_state_slots,
            preemption_mode=mode,
            swap_costs=swap_costs,
            num_disk_blocks=num_disk_blocks,
            state_cache_bytes=state_cache_bytes,
            ssm_checkpoint_interval=interval,
            ssm_snapshot_slots=snapshot_slots(config) if interval else 0,
            window_sizes=tuple(window_groups[0]),
            window_blocks=tuple(window_groups[1]),
        )


def mixed_prefill_tokens(sched: SchedulerSection, serving: bool) -> int | None:
    """scheduler.max_mixed_prefill_tokens as the engine runs it (None: no bound). Unset: SERVING_MIXED_PREFILL_TOKENS
    when serving with chunked prefill (streams' inter-token latency), no bound offline (throughput first); -1: none."""
    value = getattr(sched, "max_mixed_prefill_tokens", None)  # stand-ins of the config (tests) may lack the key
    if value is None:
        return SERVING_MIXED_PREFILL_TOKENS if serving and sched.chunked_prefill_size > 0 else None
    return None if value == -1 else int(value)


def snapshot_slots(config: ApplianceConfig) -> int:
    """State-snapshot slots of a hybrid model with prefix caching: cache.ssm_cache_slots, or one per
    max_num_seqs; the workers allocate them beside the request slots (executor/state_cache.py)."""
    return int(config.cache.ssm_cache_slots or config.scheduler.max_num_seqs)


@dataclass(frozen=True)
class StepTokens:
    """The token sizes of a step, derived once from scheduler.chunked_prefill_size / max_prefill_tokens and the
    resolved max_model_len; the scheduler, the warm-up and the GPU memory profile all read them from here.

    budget: what each step starts with (step_budget.StepBudget): the shared budget with chunking, the prefills'
    budget without. largest_chunk: the most tokens one request computes in one step: the budget with chunking
    (a request never holds more than max_model_len), max_model_len without (a prompt longer than the prefill
    budget runs whole, as its step's only prefill).
    """

    budget: int
    largest_chunk: int
    chunking: bool

    @classmethod
    def of(cls, chunked_prefill_size: int, max_prefill_tokens: int, max_model_len: int) -> StepTokens:
        if chunked_prefill_size > 0:
            return cls(chunked_prefill_size, min(chunked_prefill_size, max_model_len), True)
        return cls(max_prefill_tokens, max(max_prefill_tokens, max_model_len), False)


def host_blocks(cache: CacheSection, num_blocks: int, bytes_per_block: int | None = None) -> int:
    """The host tier's blocks: cache.host_cache_size_gb of them when set (> 0; needs the workers' bytes per
    block), else cache.host_cache_ratio x the device's (SGLang's --hicache-ratio, default 2 as there); 0 without
    cache.host_cache. The workers size their slots with it and report the count to the scheduler."""
    if not getattr(cache, "host_cache", False):  # stand-ins of the config (tests) may lack the tier's keys
        return 0
    size_gb = cache.host_cache_size_gb
    if size_gb:
        if bytes_per_block is None:
            raise ValueError("cache.host_cache_size_gb is sized by the workers (bytes per KV block)")
        n = int(size_gb * (1 << 30)) // bytes_per_block
        if n < 1:
            raise ValueError(f"cache.host_cache_size_gb={size_gb} holds no KV block of {bytes_per_block} bytes")
        return n
    ratio = cache.host_cache_ratio if cache.host_cache_ratio is not None else 2.0
    return max(1, int(num_blocks * ratio))


def disk_tier_on(cache: CacheSection) -> bool:
    """cache.disk_cache, or the storage backend `file` (SGLang's HiCacheFile), behind the host tier."""
    return bool(getattr(cache, "host_cache", False) and (
        getattr(cache, "disk_cache", False) or getattr(cache, "host_cache_storage_backend", None) == "file"))


def disk_blocks(cache: CacheSection, bytes_per_block: int) -> int:
    """The disk tier's blocks: cache.disk_cache_size_gb of them (GiB, as host_cache_size_gb); 0 without the tier.
    The workers size their files with it and report the count to the scheduler."""
    if not disk_tier_on(cache):
        return 0
    size_gb = cache.disk_cache_size_gb
    if not size_gb:
        raise ValueError("the disk tier needs cache.disk_cache_size_gb")
    n = int(size_gb * (1 << 30)) // bytes_per_block
    if n < 1:
        raise ValueError(f"cache.disk_cache_size_gb={size_gb} holds no KV block of {bytes_per_block} bytes")
    return n


def num_speculative_tokens(config: ApplianceConfig) -> int:
    """Drafts per verification: a chain of num_steps tokens (eagle_topk 1), a tree of num_draft_tokens - 1 nodes
    (eagle_topk > 1), 0 without speculative decoding."""
    spec = getattr(config, "speculative", None)
    if spec is None or spec.algorithm is None:
        return 0
    if getattr(spec, "eagle_topk", 1) > 1:
        return int(spec.effective_num_draft_tokens) - 1
    return int(spec.num_steps)


def spec_lookahead(config: ApplianceConfig) -> int:
    """Positions past a sampling chunk the drafter writes (speculation.lookahead_tokens)."""
    spec = getattr(config, "speculative", None)
    algorithm = getattr(spec, "algorithm", None)
    if algorithm is not None and getattr(spec, "eagle_topk", 1) > 1:
        return tree_scratch_tokens(algorithm, int(spec.eagle_topk), int(spec.num_steps))
    return lookahead_tokens(algorithm, num_speculative_tokens(config))
