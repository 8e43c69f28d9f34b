"""The appliance config: one frozen pydantic model per section. The single source of truth for the CLI flags,
environment variables, docs/parameters.md and schemas/appliance.schema.json."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

from appliance.config.fields import param
from appliance.config.sections_engine import (
    BackendsSection,
    CacheSection,
    ModelSection,
    ParallelismSection,
    PrecisionSection,
    SchedulerSection,
    Section,
)
from appliance.config.sections_serving import (
    ApiCaps,
    ApiSection,
    KvEventsConfig,
    MultimodalSection,
    ObservabilitySection,
    SamplingSection,
    SpeculativeSection,
)

SKIP_CROSS_CHECKS = "skip_cross_checks"


class ApplianceConfig(BaseModel):
    """A whole deployment: what to serve, how, and where."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True,
                              title="appliance configuration")

    model: ModelSection = param(default_factory=ModelSection, description="Which model to serve.", flags=None)
    precision: PrecisionSection = param(default_factory=PrecisionSection, description="Number formats.",
                                        flags=None)
    parallelism: ParallelismSection = param(default_factory=ParallelismSection, description="GPU split.",
                                            flags=None)
    scheduler: SchedulerSection = param(default_factory=SchedulerSection, description="Batching.", flags=None)
    cache: CacheSection = param(default_factory=CacheSection, description="KV cache.", flags=None)
    backends: BackendsSection = param(default_factory=BackendsSection, description="Kernel backends.",
                                      flags=None)
    speculative: SpeculativeSection = param(default_factory=SpeculativeSection,
                                            description="Speculative decoding.", flags=None,
                                            json_flag="--speculative-config")
    multimodal: MultimodalSection = param(default_factory=MultimodalSection,
                                          description="Image and video inputs.", flags=None)
    api: ApiSection = param(default_factory=ApiSection, description="HTTP API.", flags=None)
    sampling: SamplingSection = param(default_factory=SamplingSection, description="Default sampling.",
                                      flags=None)
    observability: ObservabilitySection = param(default_factory=ObservabilitySection,
                                                description="Logs, metrics, events.", flags=None)

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> ApplianceConfig:
        # build_config runs the same checks itself to attach file lines; direct construction gets them here.
        if info.context and info.context.get(SKIP_CROSS_CHECKS):
            return self
        from appliance.config.checks import check_consistency

        problems = check_consistency(self)
        if problems:
            raise ValueError("; ".join(f"{p.path}: {p.message}" for p in problems))
        return self

    def overlap_enabled(self) -> bool:
        """scheduler.enable_overlap as the engine runs it: unset means on, unless speculative decoding is set."""
        if self.scheduler.enable_overlap is not None:
            return self.scheduler.enable_overlap
        return self.speculative.algorithm is None

    def __hash__(self) -> int:  # usable as a cache key although hf_overrides is a dict
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


SECTIONS: dict[str, type[Section]] = {
    name: field.annotation for name, field in ApplianceConfig.model_fields.items()  # type: ignore[misc]
}

__all__ = [
    "ApiCaps", "ApiSection", "ApplianceConfig", "BackendsSection", "CacheSection", "KvEventsConfig",
    "ModelSection", "MultimodalSection", "ObservabilitySection", "ParallelismSection", "PrecisionSection", "SECTIONS",
    "SamplingSection", "SchedulerSection", "Section", "SpeculativeSection",
]
