"""Utilities run from the repository root as `python -m tools.NAME`: the embedded model's trainer
(train_default_model, default_model/), the kernel labs that regenerate tuned tables in appliance/kernels
(lab_cublaslt, lab_gemm), a request-dump replayer, a KV-event subscriber, the soak run, the docs generator and
the measurement of `appliance translate` on its corpus (translate_corpus)."""
