"""`expresslane bench`: a load generator and report for any OpenAI-compatible endpoint.

Files, one concept each:

- `records.py`: `RequestRecord`, the raw client-side timestamps and server counts of a request,
  and `TaskRecord`, what an agent task did besides its requests.
- `workloads.py`: `Turn`, `Reply`, the `SessionLike` protocol (next turn from the last reply),
  `Session` (fixed turns), the `Workload` protocol and the registry of workloads by name
  (`synthetic.py`, `replay.py`, `agent.py`).
- `agent.py`: the coding-agent workload; `agent_tools.py` its tools (real or simulated),
  `sandbox.py` its task set (`tasks/`) and temporary copies; `agent_metrics.py` the split of a
  task's time.
- `target.py`: the endpoint under test and the request bodies for Chat and Responses.
- `events.py`: streamed events (SSE or WebSocket) into a record's fields and the reply (text and
  tool calls).
- `retry.py`: which failures are retried and how long to wait.
- `transport.py`: the `Sender`/`Transport` types; `client.py` (HTTP + SSE) and `ws_client.py`
  (Responses WebSocket mode) implement them.
- `schedule.py`: seeded Poisson arrival times (open loop).
- `runner.py`: closed-loop (concurrency) and open-loop (rate) runs, sessions, warmup, progress.
- `checks.py`: whether structured outputs parse and validate and forced tool calls came back,
  per request and counted per run.
- `metrics.py`: TTFT, TPOT, ITL, E2E, throughput, goodput from records, and their definitions.
- `headline.py`: the headline numbers shown in tables.
- `report.py`: `results.json` (schema in its docstring) and `report.md`; `plots.py`: the PNGs
  (`task_breakdown.png` for agent runs).
- `compare.py`: `expresslane bench compare A B`.
- `cli.py`: the `bench` command line.
"""
