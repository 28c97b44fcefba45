"""Grammar-constrained decoding on llguidance: one matcher per constrained request.

A request whose `SamplingParams.grammar` is set gets a matcher at admission (a copy of one
compiled per grammar text and cached, so a schema is compiled once). Before each model step
`GrammarMatchers.start` fills the token masks of every constrained row of the batch (on a GPU on
a worker thread while the forward pass runs; on a CPU, whose cores the forward pass keeps busy,
inline); the sampler masks the logits with them (`StepMasks.apply`, a native kernel on a CPU).
The tokens a grammar forces next are guessed (`GuessPlanner.add_forced`). A row that
verifies a speculative guess gets the mask of the state after the guesses before it (llguidance
walks the guesses and rolls back), so the constrained distribution is the same with and without
speculation. After the step `advance` feeds the accepted tokens to the matcher. A complete
grammar allows only the end token, so the request ends the same way with and without guesses.

Why llguidance (and not xgrammar): on these CPUs both fill a mask of the demo vocabulary in about
10 us (benchmarks/grammar_backends.py), llguidance compiles a schema 2-5x faster, needs no other
package (xgrammar pulls in transformers and triton), and has lazy lexemes and special-token
terminals that tool-call grammars are written with.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from expresslane.engine.request import Request
from expresslane.errors import InvalidRequestError
from expresslane.kernels import cpu_kernels
from expresslane.sampling_params import Grammar

CACHED_GRAMMARS = 256


def _words(vocab: int) -> int:
    return (vocab + 31) // 32


@dataclass
class StepMasks:
    """The token masks of one step: `bitmask` rows from `rows[id(req)]` on, one per sampled
    row of that request (its position, then one per guess)."""

    rows: dict[int, int]
    bitmask: torch.Tensor  # int32 [rows, words], bit t of a row set: token t allowed
    done: Future | None  # None: filled already

    def apply(
        self, logits: torch.Tensor, reqs: list[Request], offsets: list[int] | None
    ) -> torch.Tensor:
        """`logits` (float32 [B, V], changed in place) with -inf for the tokens the grammars
        of its rows do not allow."""
        pairs = [
            (i, self.rows[id(r)] + (offsets[i] if offsets else 0))
            for i, r in enumerate(reqs)
            if id(r) in self.rows
        ]
        if not pairs:
            return logits
        if self.done is not None:
            self.done.result()
        rows = torch.tensor([i for i, _ in pairs])
        sources = torch.tensor([j for _, j in pairs])
        if _native(logits):
            cpu_kernels().apply_token_bitmask(logits, rows, self.bitmask, sources)
            return logits
        allowed = unpack(self.bitmask[sources], logits.shape[1]).to(logits.device)
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [R, vocab] from int32 [R, words] bitmask rows."""
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(words.shape[0], -1)[:, :vocab].bool()


def _native(logits: torch.Tensor) -> bool:
    cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    return cpu and logits.dim() == 2 and logits.stride(1) == 1 and cpu_kernels() is not None


class GrammarMatchers:
    """Compiles grammars (cached), makes per-request matchers, fills step masks."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], overlap: bool
    ):
        self.vocab_size = vocab_size
        self.overlap = overlap  # fill masks on a worker thread while the forward pass runs
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # requests are made on server threads
        self._executor = llguidance.LLExecutor()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    # -- admission ------------------------------------------------------------------------

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`; InvalidRequestError naming `grammar.param` when the
        grammar (a schema, a tool's parameters) cannot be compiled."""
        with self._lock:
            template = self._compiled.get(grammar.lark)
            if template is not None:
                self._compiled.move_to_end(grammar.lark)
                return template.deep_copy()
        template = llguidance.LLMatcher(self.tokenizer, grammar.lark, log_level=0)
        if template.is_error():
            raise InvalidRequestError(
                f"{grammar.param}: {_first_line(template.get_error())}", param=grammar.param
            )
        with self._lock:
            self._compiled[grammar.lark] = template
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def literal(self, text: str) -> str:
        """`text` as a Lark sequence: special tokens (`<tool_call>`, `[TOOL_CALLS]`) as token
        terminals, the rest as quoted strings."""
        parts, plain = [], []
        for token in self.tokenizer.tokenize_str(text, parse_special=True):
            if self.tokenizer.is_special_token(token):
                if plain:
                    parts.append(json.dumps(self.tokenizer.decode_str(plain)))
                    plain = []
                parts.append(f"<[{token}]>")
            else:
                plain.append(token)
        if plain:
            parts.append(json.dumps(self.tokenizer.decode_str(plain)))
        return " ".join(parts) if parts else '""'

    # -- stepping -------------------------------------------------------------------------

    def start(self, items: list[tuple[Request, int]]) -> StepMasks | None:
        """Start filling the masks of this step's constrained rows; None when there are
        none (the step then costs nothing extra)."""
        sampled = [
            r
            for r, n in items
            if r.matcher is not None and r.num_computed_tokens + n >= r.num_tokens
        ]
        if not sampled:
            return None
        rows, plain, guessed, total = {}, [], [], 0
        for req in sampled:
            rows[id(req)] = total
            guesses = req.spec.guesses[: req.matcher.validate_tokens(req.spec.guesses)]
            if guesses:
                guessed.append((req.matcher, total, guesses))
            else:
                plain.append((req.matcher, total))
            total += len(req.spec.guesses) + 1  # rows past an invalid guess stay unconstrained
        bitmask = torch.full((total, _words(self.vocab_size)), -1, dtype=torch.int32)
        if not self.overlap:
            self._fill(plain, guessed, bitmask)
            return StepMasks(rows, bitmask, None)
        return StepMasks(rows, bitmask, self._worker.submit(self._fill, plain, guessed, bitmask))

    def _fill(self, plain: list, guessed: list, bitmask: torch.Tensor) -> None:
        size, ptr = bitmask.shape[1] * 4, bitmask.data_ptr()
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, ptr, size, bitmask.shape[0])
        if guessed:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                guessed, ptr, size, bitmask.shape[0]
            )

    def advance(self, req: Request, num_new: int) -> bool:
        """Feed the request's `num_new` newest tokens to its matcher; True when the grammar is
        complete. Raises when a token breaks the grammar (a bug, not input)."""
        if req.matcher is None or not num_new:
            return False
        matcher = req.matcher
        for token in req.token_ids[-num_new:]:
            if matcher.is_stopped():
                break  # the end token a complete grammar allows
            if not matcher.consume_token(token):
                raise RuntimeError(f"grammar rejected token {token}: {matcher.get_error()}")
        return matcher.is_stopped()


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "invalid grammar"
