"""The byte-level BPE tokenizer: trained on the training split, written in the HF layout, and used to turn
documents into one token stream (bos doc eos bos doc eos ...)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tools.default_model.chat_format import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    # Like Llama's tokenizers: encode() prepends bos; the chat template writes bos itself and callers encode
    # templated chats with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def write_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "pad_token": PAD, "unk_token": None, "add_bos_token": True, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": max_len,
              "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(1)
        ids.extend(enc.ids)
        ids.append(2)
    return torch.tensor(ids, dtype=torch.int32)
