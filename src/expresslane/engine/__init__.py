"""The engine: requests, paged KV cache bookkeeping, scheduler, model runner, sampler, and
the synchronous (`LLMEngine`) and asynchronous (`AsyncEngine`) step loops."""
