"""The special tokens and the chat format of the default model: what the shipped tokenizer_config.json holds
and what the training chats were rendered with (tests/test_default_model_tool.py checks they agree)."""
from __future__ import annotations

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render_chat(user: str, assistant: str) -> str:
    """The chat template's rendering of one exchange (without bos, which encode() adds)."""
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"
