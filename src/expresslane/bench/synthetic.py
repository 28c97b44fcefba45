"""The `synthetic` workload: seeded random prompts of about `input_tokens` words.

Words come from a fixed vocabulary of common English and code words, so prompt lengths mean
roughly the same number of tokens with any tokenizer. Every request asks for `output_tokens`
(default 128) tokens with `ignore_eos` (unless turned off) so output lengths are fixed. With
`prefix_tokens`, every prompt starts with the same shared prefix (to exercise prefix caching).
Prompts never repeat within one benchmark invocation: the random state carries over from run
to run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from expresslane.bench.workloads import Session, Turn, WorkloadOptions, register

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or an at not but "
    "have all can one more time when will about which their there would what some into other "
    "than then them these so people only new first also after over well way even because any "
    "most us work through back good give under know between system model request server "
    "token cache batch queue latency memory thread stream value result error number string "
    "list table index user agent tool call answer question plan step data file line word "
    "def class return import from self none true false if else elif for while try except "
    "raise with yield lambda async await print len range dict int str float bool append "
    "json http path config args kwargs init main test assert open read write close update"
)
VOCABULARY: tuple[str, ...] = tuple(_WORDS.split())


class SyntheticWorkload:
    name = "synthetic"

    def __init__(self, options: WorkloadOptions):
        self.options = options
        self.rng = random.Random(options.seed)
        # The shared prefix has its own stream so it doesn't depend on how many prompts ran.
        prefix_rng = random.Random(f"prefix-{options.seed}")
        self.prefix = " ".join(prefix_rng.choices(VOCABULARY, k=options.prefix_tokens))

    def prompt(self) -> str:
        words = self.rng.choices(VOCABULARY, k=max(self.options.input_tokens, 1))
        body = " ".join(words)
        return f"{self.prefix} {body}" if self.prefix else body

    def sessions(self) -> Iterator[Session]:
        extra = {"ignore_eos": True} if self.options.ignore_eos else {}
        while True:
            turn = Turn(
                messages=[{"role": "user", "content": self.prompt()}],
                max_tokens=self.options.max_tokens(128),
                extra=dict(extra),
            )
            yield Session(id=None, turns=[turn])

    def default_requests(self) -> int | None:
        return 100


@register("synthetic")
def _synthetic(arg: str | None, options: WorkloadOptions) -> SyntheticWorkload:
    if arg:
        raise ValueError("the synthetic workload takes no argument; use --input-tokens etc.")
    return SyntheticWorkload(options)
