"""The pieces of tools/train_default_model.py, one concept each:

- chat_format: the special tokens, the chat template and its rendering (the contract the shipped model relies on)
- corpus: the Python standard library (sources, pydoc topics, derived chats) split into train / validation
- tokenizer: the byte-level BPE tokenizer, its HF files, token streams
- training: the Llama config, the seeded training loop with its evaluation
- export: safetensors weights (sharded or whole) and the HF config files
- report: samples and the parse fraction from the saved files
"""
