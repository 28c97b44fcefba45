"""The OpenAI-compatible HTTP/SSE/WebSocket server: Responses API (with a SQLite response
store, background mode and WebSocket mode), Chat Completions, Completions, Models, health and
Prometheus metrics. It reaches the engine only through `AsyncEngine`."""
