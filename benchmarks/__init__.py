"""The acceptance suites that reproduce the figures of docs/benchmarks.md and docs/kernels.md on a GPU host.
Run from the repository root: `python -m benchmarks.NAME` (Python) or `bash benchmarks/NAME.sh`.

- gpu_suite.sh: the published single-GPU figures (Llama-3.1-8B and Qwen3-0.6B shapes), ours and vLLM's
- sessions.sh: agentic multi-turn sessions (`appliance bench sessions`): KV pool 3x oversubscribed with and
  without the host tier, vLLM's figure, and the slo / fcfs mixed load (docs/scheduling.md)
- kernels.py: every Triton kernel against its torch reference, then timed (docs/kernels.md)
- tp.py: tensor parallelism on 2 GPUs (docs/parallelism.md)
- deepseek_v3.py: recipes/deepseek-v3.toml served on the DeepSeek-V3 shape, MTP off and on
- spec_decode.py: speculative decoding (EAGLE-3 with forced acceptance, n-gram) against plain decoding
- moe.sh: the MoE shapes (DeepSeek-V2-Lite, Qwen3-30B-A3B) and their kernels
- flashinfer.sh: the flashinfer attention backend's GPU tests and timings
- server.py: start / stop `appliance run` and measure it with `appliance bench serve` (used by the suites)
- host_path.py: the tokenizer and scheduler stages in front of a worker of a fixed step time (host_path_stage.py),
  measured with `appliance bench serve`: the host path alone, on any machine's CPU
- fp8.py: FP8 weights and the FP8 KV cache against 16-bit on the Llama-3.1-8B and Qwen3-0.6B shapes
- models.py, hybrid.py: the model families (gpt-oss, Gemma 3; the Qwen3-Next shape); peer_models.py runs their
  workloads through vLLM (peer_measure.py, peer_kv.py) under the peer kit's Python path
"""
