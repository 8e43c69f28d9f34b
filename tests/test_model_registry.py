"""The model registry's table of architectures against the model modules' own MODELS, and its lazy imports."""
from __future__ import annotations

import importlib
import subprocess
import sys

from appliance.models import registry


def test_table_matches_each_modules_models() -> None:
    modules = set(registry.ARCHITECTURES.values())
    for module in modules:
        classes = importlib.import_module(f"appliance.models.{module}").MODELS
        named = {a for a, m in registry.ARCHITECTURES.items() if m == module}
        assert named == set(classes), module
        for arch in named:
            assert registry.MODELS[arch] is classes[arch]


def test_lookup_imports_only_the_models_module() -> None:
    code = ("import sys; from appliance.models.registry import model_class\n"
            "class C: architectures = ['LlamaForCausalLM']\n"
            "assert model_class(C).__name__ == 'LlamaForCausalLM'\n"
            "print(sorted(m for m in sys.modules if m.startswith('appliance.models.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)  # noqa: S307 (our own subprocess' list of names)
    assert "appliance.models.llama" in loaded
    assert not {"appliance.models.deepseek", "appliance.models.qwen3_next", "appliance.models.mixtral"} & set(loaded)


def test_unknown_architecture_names_the_supported_ones() -> None:
    class Config:
        architectures = ["NopeForCausalLM"]

    try:
        registry.model_class(Config)
    except ValueError as exc:
        assert "NopeForCausalLM" in str(exc) and "LlamaForCausalLM" in str(exc)
    else:
        raise AssertionError("an unknown architecture must fail")
