"""Shared by the decode-graph tests: a runner's decode steps routed through DecodeGraphs built by hand (whatever
graph_settings says). On a CPU the same static, padded buffers run without capture."""
from __future__ import annotations

from typing import Any

from appliance.executor.cuda_graph import DecodeGraphs, GraphKey


def use_graphs(llm: Any, sizes: list[int], unsplit_from: int | None = None) -> tuple[DecodeGraphs, list[GraphKey]]:
    """Give the runner of `llm` decode graphs for `sizes` (a hybrid model's rows name their state slots); returns
    them and the list of keys they run, which fills as steps replay."""
    r = llm.executor.runner
    graphs = DecodeGraphs(r.model, int(r.hf_config.hidden_size), r.dtype, r.device, sizes, r.max_blocks,
                          r.block_size, unsplit_from=unsplit_from, with_states=r.state_cache is not None)
    r.graphs, r.use_graphs = graphs, True
    keys: list[GraphKey] = []
    run = graphs.run

    def recording(decodes: list[Any], key: GraphKey, *rest: Any) -> Any:
        keys.append(key)
        return run(decodes, key, *rest)

    graphs.run = recording  # type: ignore[method-assign]
    return graphs, keys
