"""The command line: `expresslane serve|generate|chat|bench|quantize|perplexity|keys|usage|
cluster`. `main.py` builds the parser from each command's module (`serve.py` and `serving.py`
for the server, `engine.py` for the engine's flags, `accounts.py`, `quant.py`, `cluster.py`;
`bench` is `bench/cli.py`); `arg_types.py` checks values as they are parsed."""

from expresslane.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
