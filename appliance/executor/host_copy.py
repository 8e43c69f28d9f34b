"""The host tier's block copies (engine/host_tier.py) beside the forward.

On a GPU a plan's copies run on a side stream, layer by layer, each layer's copies closed by an event. The side
stream first waits for everything the compute stream was given before (a store then reads a block after the
steps in flight wrote it; a load's block is no longer read by them). The step's forward waits for layer i's
event just before layer i first touches its cache (`kv_ready` of the attention layers), so layer i's copies run
while the layers before it compute; a forward that is replayed from a graph (decode graphs, piecewise pieces,
whose cache accesses are captured) or runs layers without the hook waits for the last event before it starts.
Either way the wait is one stream waiting on an event: the host never waits, and no device-wide sync happens.
On the CPU the copies run synchronously in the same order (`Inline`), so the same interface is exercised.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Protocol

import torch

from appliance.executor.kv_cache import coalesce, copy_layer_runs

Caches = list[tuple[torch.Tensor, torch.Tensor | None]]


class CopyStream(Protocol):
    """Where the copies run and how the compute stream waits for them."""

    def begin(self) -> None:
        """The copies issued after this see all work issued to the compute stream before it."""

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Copies issued inside run on the copy stream."""

    def mark(self) -> object | None:
        """A marker after the copies issued so far (None: they are done already)."""

    def wait(self, mark: object) -> None:
        """The compute stream waits for the marker (never the host)."""


class Inline:
    """The CPU: copies run at once, in order; nothing to wait for."""

    def begin(self) -> None:
        pass

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def mark(self) -> object | None:
        return None

    def wait(self, mark: object) -> None:
        pass


class SideStream:
    """A CUDA side stream; markers are CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def mark(self) -> object | None:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, mark: object) -> None:
        assert isinstance(mark, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(mark)


class HostCopier:
    """Runs plans' (direction, block, slot) copies between the device caches and the host tier's slots."""

    def __init__(self, device_caches: Caches, host_caches: Caches, stream: CopyStream) -> None:
        self.device_caches, self.host_caches, self.stream = device_caches, host_caches, stream
        self._marks: list[object | None] = [None] * len(device_caches)  # per cache layer, not yet waited for
        self.layerwise = False  # every cache layer's attention calls its kv_ready hook (bind_layers)

    @classmethod
    def for_device(cls, device_caches: Caches, host_caches: Caches, device: torch.device) -> HostCopier:
        stream: CopyStream = SideStream(device) if device.type == "cuda" and host_caches else Inline()
        return cls(device_caches, host_caches, stream)

    def bind_layers(self, layers: list[Any]) -> None:
        """Give each cache layer's attention its wait (layer i of `layers` owns device_caches[i]); layer-by-layer
        waits only when every layer takes the hook, else the forward waits for all copies first."""
        hooked = all(hasattr(layer, "kv_ready") for layer in layers) and len(layers) == len(self.device_caches)
        for i, layer in enumerate(layers):
            if hasattr(layer, "kv_ready"):
                layer.kv_ready = partial(self.wait_layer, i) if hooked else None
        self.layerwise = hooked

    def submit(self, copies: list[tuple[int, int, int]]) -> None:
        """Issue a plan's copies, layer by layer, in the plan's order within each layer."""
        if not copies:
            return
        if not self.host_caches:
            raise RuntimeError("the plan carries host-tier copies but this worker has no host tier")
        runs = coalesce(copies)
        self.stream.begin()
        with self.stream.scope():
            for i, (dev_pair, host_pair) in enumerate(zip(self.device_caches, self.host_caches, strict=True)):
                copy_layer_runs(dev_pair, host_pair, runs)
                self._marks[i] = self.stream.mark()

    def wait_layer(self, layer: int) -> None:
        """The compute stream waits for this layer's copies (a no-op once waited, or without copies)."""
        mark = self._marks[layer]
        if mark is not None:
            self._marks[layer] = None
            self.stream.wait(mark)

    def wait_all(self) -> None:
        """The compute stream waits for every copy issued (the last layer's marker closes them all)."""
        last = self._marks[-1] if self._marks else None
        self._marks = [None] * len(self._marks)
        if last is not None:
            self.stream.wait(last)
