"""tokenization/tokenizer.py: a tokenizer AutoTokenizer would load as the generic tokenizer.json class is loaded as
that class directly, equal to AutoTokenizer's, and the HTTP process' tokenizer then costs no torch import."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import (
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
    TOKENIZER_MAPPING_NAMES,
    tokenizer_class_from_name,
)

from appliance.bench.presets import write_model_dir
from appliance.config import resolve_model_path
from appliance.tokenization import load_tokenizer
from appliance.tokenization.tokenizer import (
    GENERIC_CLASSES,
    GENERIC_MODEL_TYPES,
    loads_as_generic,
)

DEFAULT = Path(resolve_model_path(None))
SAMPLES = ["Hello world, this is a test.", "  leading spaces and ünïcödé 字 🙂", "<|endoftext|> w12 w7 x", ""]


@pytest.fixture(scope="module")
def preset_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Llama-3.1-8B and Qwen3-0.6B presets' directories with their word-level tokenizers."""
    out = tmp_path_factory.mktemp("preset")
    return {name: write_model_dir(name, out / name, True) for name in ("llama-3.1-8b", "qwen3-0.6b")}


def copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("which", ["default", "llama-3.1-8b", "qwen3-0.6b"])
def test_generic_tokenizer_equals_autotokenizers(which: str, preset_dirs: dict[str, Path]) -> None:
    model_dir = DEFAULT if which == "default" else preset_dirs[which]
    assert loads_as_generic(model_dir)
    ours = load_tokenizer(str(model_dir))
    theirs = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.init_kwargs == theirs.init_kwargs
    assert {k: repr(v) for k, v in vars(ours).items()} == {k: repr(v) for k, v in vars(theirs).items()}
    assert ours.get_vocab() == theirs.get_vocab() and ours.all_special_ids == theirs.all_special_ids
    for text in SAMPLES:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
    if theirs.chat_template:
        messages = [{"role": "user", "content": SAMPLES[0]}]
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_other_tokenizers_go_through_autotokenizer(tmp_path: Path) -> None:
    cases = {"qwen2": ("config.json", {"model_type": "qwen2"}),
             "remote code": ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["x.T", None]}}),
             "model remote code": ("config.json", {"auto_map": {"AutoConfig": "x.C"}}),
             "named class": ("tokenizer_config.json", {"tokenizer_class": "LlamaTokenizerFast"})}
    for name, (file, change) in cases.items():
        model_dir = copy_model(DEFAULT, tmp_path / name.replace(" ", "_"))
        edit_json(model_dir / file, **change)
        assert not loads_as_generic(model_dir), name
    bare = copy_model(DEFAULT, tmp_path / "no_tokenizer_json")
    (bare / "tokenizer.json").unlink()
    assert not loads_as_generic(bare)
    assert loads_as_generic(copy_model(DEFAULT, tmp_path / "copy"))


def test_autotokenizer_picks_the_generic_class_for_these_model_types() -> None:
    """The premise of the direct load, as AutoTokenizer's selection reads it in this transformers: none of these
    types is on its list of wrong hub classes (so the class tokenizer_config.json names is used), none maps to
    the Mistral backend, and the generic names resolve to one class."""
    for model_type in GENERIC_MODEL_TYPES:
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"
    classes = {tokenizer_class_from_name(name) for name in GENERIC_CLASSES}
    assert len(classes) == 1 and next(iter(classes)).__name__ == "TokenizersBackend"


def test_http_process_tokenizer_imports_no_torch() -> None:
    """What the tokenizer stage prepares (runtime/tokenizer_proc.py) and a chat request's use of the tokenizer."""
    code = ("import sys\n"
            "from appliance.config import build_config\n"
            "from appliance.runtime.tokenizer_proc import load_server_tokenizer\n"
            "import appliance.server.app\n"
            "tok = load_server_tokenizer(build_config())\n"
            "text = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,"
            " add_generation_prompt=True)\n"
            "assert tok.decode(tok.encode(text))\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'sympy'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
