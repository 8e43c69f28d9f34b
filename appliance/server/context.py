"""Everything the routes share: config, tokenizer, engine client, template, limits, metrics."""
from __future__ import annotations

import asyncio
import copy
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from appliance.server.chat_template import ChatTemplate
from appliance.server.engine_client import EngineClient
from appliance.server.errors import ApiError
from appliance.server.sampling import Limits

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

T = TypeVar("T")


@dataclass
class ServerContext:
    config: ApplianceConfig
    tokenizer: Any  # a HF-style tokenizer (encode, decode, convert_ids_to_tokens)
    engine: EngineClient
    model_name: str
    limits: Limits
    chat_template: ChatTemplate | None
    obs: Any  # observability.FrontendObservability: /metrics registry, request log, request dump
    created: int = field(default_factory=lambda: int(time.time()))
    response_store: Any = None  # server/responses.py's ResponseStore, made on the first /v1/responses request
    # Tokenization and template rendering run on one thread, off the event loop (so /health and streams stay
    # responsive), with their own copy of the tokenizer: a HF fast tokenizer used from two threads at once can
    # fail with "Already borrowed". The event loop keeps `tokenizer` for incremental detokenization.
    _tok_thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenize"))
    _thread_tokenizer: Any = None

    def __post_init__(self) -> None:
        self._thread_tokenizer = copy.deepcopy(self.tokenizer)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer / template work on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tok_thread, functools.partial(fn, *args))

    def http_error(self, status: int) -> None:
        if self.obs is not None and self.obs.metrics is not None:
            self.obs.metrics.on_http_error(status)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def admit(self, model: str | None, n: int, num_requests: int) -> None:
        """A generation request's checks before any template or tokenization work: the model, `n` within its cap
        (a 400 ahead of the 429), then room in the queue for its `num_requests` engine requests."""
        self.check_model(model)
        self.limits.check_n(n)
        self.engine.check_capacity(num_requests)

    @property
    def cache_report(self) -> bool:
        return bool(self.config.observability.enable_cache_report)

    @property
    def request_timeout(self) -> float | None:
        t = float(self.config.api.request_timeout or 0)
        return t if t > 0 else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """On the tokenizer thread only (see off_loop)."""
        return list(self._thread_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_off_loop(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """On the tokenizer thread only (see off_loop)."""
        return self._thread_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """On the event loop (short texts: echo of a prompt)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def make_context(config: ApplianceConfig, tokenizer: Any, engine: EngineClient, *, max_model_len: int,
                 vocab_size: int, obs: Any = None) -> ServerContext:
    """Everything resolved once at start-up: a bad chat template fails here, not per request."""
    from appliance.server.chat_template import load_template_source

    source = load_template_source(config.api.chat_template, tokenizer)
    template = None
    if source is not None:
        template = ChatTemplate(source, bos_token=getattr(tokenizer, "bos_token", None),
                                eos_token=getattr(tokenizer, "eos_token", None))
    name = served_model_name(config)
    if obs is None:
        from appliance.observability import FrontendObservability

        obs = FrontendObservability(config, name, max_model_len)
    return ServerContext(config=config, tokenizer=tokenizer, engine=engine, model_name=str(name),
                         limits=Limits.from_config(config, max_model_len, vocab_size), chat_template=template,
                         obs=obs)


def served_model_name(config: ApplianceConfig) -> str:
    return str(config.api.served_model_name or config.model.path or "default")
