"""Proposers replayed offline on recorded sessions: what each would cost, without the model.

Greedy output does not depend on the proposer (tests check it token for token), so the
sessions of `spec_sessions.py` are generated once, plainly, and then every proposer is
stepped through them as the engine would: each step it proposes up to `--k` guesses, the
planner's rule (`best_length` over the request's acceptance for the proposal's kind) cuts
them, and the recorded output says how many are kept. A step is priced by a line,
`--step-ms` plus `--row-ms` per verified row (one row per guess and one for the model's own
token), fitted to a measured run; the defaults, 8.7 ms and 2.2 ms, fit `spec.py --sessions`
on SmolLM2-135M at one thread on a Zen 4 core (BENCHMARKS.md, issue 49) and reproduce its
step counts within 5%. "oracle" guesses the recorded output itself: the most any proposer
could gain here under that price.

    python benchmarks/spec_replay.py --model smollm2 [--sessions 24] [--turns 4]
        [--workloads agent,chat] [--max-tokens 192] [--k 12] [--step-ms 8.7] [--row-ms 2.2]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import spec_sessions
from common import real_smollm2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expresslane import SamplingParams  # noqa: E402
from expresslane.engine.speculation import NgramProposer, SuffixProposer, best_length  # noqa: E402
from expresslane.engine.speculation.acceptance import LaneAcceptance  # noqa: E402
from expresslane.engine.speculation.proposal import Proposal  # noqa: E402


@dataclass
class Replayed:
    """What a proposer reads of a request: its tokens, id, owner and prompt length."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str = "agent"

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Oracle:
    """Guesses the recorded output."""

    free = True

    def __init__(self, outputs: dict[str, list[int]]):
        self.outputs = outputs

    def propose(self, requests, lengths):
        return [
            Proposal(self.outputs[r.request_id][r.num_output_tokens : r.num_output_tokens + k])
            for r, k in zip(requests, lengths, strict=True)
        ]

    def release(self, request_id: str) -> None:
        pass


def record(path, workload: str, args) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of every turn of every session, plain greedy decoding."""
    llm, _ = spec_sessions.load(path, "plain", args.k)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    out = []
    for system, turns, _ in spec_sessions.sessions(workload, args.sessions, args.turns):
        chat = [{"role": "system", "content": system}]
        for user in turns:
            chat.append({"role": "user", "content": user})
            engine = llm.engine
            prompt = llm.tokenizer.apply_chat_template(chat)
            req = engine.add_request(prompt, params, lane="ultrafast", cache_salt="agent")
            while engine.has_unfinished():
                engine.step()
            out.append((req.token_ids[: req.num_prompt_tokens], req.output_token_ids))
            text = engine.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            chat.append({"role": "assistant", "content": text})
    return out


def replay(requests, proposer, args) -> dict:
    """Steps, verified rows and priced seconds of decoding `requests` in order."""
    lane = LaneAcceptance()
    steps = rows = 0

    def price(n: int) -> float:
        return args.step_ms + args.row_ms * (1 + n)

    for i, (prompt, output) in enumerate(requests):
        req = Replayed(f"r{i}", [*prompt, *output[:1]], len(prompt))
        tallies: dict = {}
        while req.num_output_tokens < len(output):
            room = min(args.k, args.max_tokens - req.num_output_tokens - 1)
            guesses, kind = [], 0
            if room > 0:
                proposal = proposer.propose([req], [room])[0]
                guesses, kind = proposal.token_ids[:room], proposal.kind
            if guesses:
                rate = lane.rate(tallies, kind)
                guesses = guesses[: best_length(rate, len(guesses), price)]
            at, kept = req.num_output_tokens, 0
            while kept < len(guesses) and output[at + kept : at + kept + 1] == [guesses[kept]]:
                kept += 1
            if guesses:
                lane.record(tallies, kind, kept, len(guesses))
            req.token_ids += output[at : at + kept + 1]
            steps, rows = steps + 1, rows + 1 + len(guesses)
        proposer.release(req.request_id)
    seconds = (steps * args.step_ms + rows * args.row_ms) / 1e3
    return {"steps": steps, "rows": rows, "seconds": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="smollm2: the real model")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--workloads", default="agent,chat")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--k", type=int, default=12)
    ap.add_argument("--step-ms", type=float, default=8.7)
    ap.add_argument("--row-ms", type=float, default=2.2)
    args = ap.parse_args()
    path = real_smollm2() if args.model == "smollm2" else args.model
    for workload in args.workloads.split(","):
        requests = record(path, workload, args)
        outputs = {f"r{i}": out for i, (_, out) in enumerate(requests)}
        proposers = {
            "ngram": NgramProposer(1, 4),
            "suffix": SuffixProposer(),
            "oracle": Oracle(outputs),
        }
        rows = {name: replay(requests, p, args) for name, p in proposers.items()}
        for row in rows.values():
            row["vs_ngram"] = round(rows["ngram"]["seconds"] / row["seconds"], 3)
        print(f"{workload}: {rows}", flush=True)


if __name__ == "__main__":
    main()
