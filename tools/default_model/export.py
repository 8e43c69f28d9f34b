"""Writing the trained model in the HF layout: model.safetensors (or shards under a file-size limit, re-joined
by merge_shards), config.json and generation_config.json."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def save_weights(state: dict[str, torch.Tensor], out: Path, max_file_mb: float | None) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}  # tied to embed_tokens
    limit = None if max_file_mb is None else int(max_file_mb * 2**20)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if limit is None or size <= limit:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; the file ships in a package
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and used + nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = tensors[name]
        used += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def merge_shards(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {}
    for fname in files:
        tensors.update(load_file(str(directory / fname)))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(directory / "model.safetensors", 0o644)
    for fname in files:
        (directory / fname).unlink()
    index_path.unlink()
    print(f"merged {len(files)} shards into {directory / 'model.safetensors'}")


def write_configs(out: Path, config: dict[str, Any]) -> None:
    """config.json and generation_config.json (eos: <|endoftext|> and <|im_end|>, so chats stop too)."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen_config = {"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0, "do_sample": True,
                  "temperature": 0.8, "max_new_tokens": 256}
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
