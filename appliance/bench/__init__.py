"""Benchmarks with vLLM's flag and metric names: `appliance bench throughput | latency` drive the offline engine
(offline.py), `appliance bench serve` any OpenAI-compatible server (client.py); workloads.py makes the requests,
presets.py the published model shapes and their workloads, report.py the metrics, the printed block and the JSON.
The command line is appliance/cli/bench_cmd.py; docs/benchmarks.md lists the published figures."""
