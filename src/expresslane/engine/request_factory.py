"""`RequestFactory`: validate and tokenize a request, without the model's weights.

The engine makes its requests with one; a fleet's ingress (fleet/remote_engine.py) has one of
its own, so bad input fails there, before any replica is asked. It needs only the model
directory's config, tokenizer and generation config."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from expresslane.engine.admission import check_params, tokenize
from expresslane.engine.grammar import GrammarMatchers
from expresslane.engine.output import TextState
from expresslane.engine.request import Request
from expresslane.engine.submission import Submission
from expresslane.errors import InvalidRequestError
from expresslane.lanes import Lane, is_served, served
from expresslane.models.config import ModelConfig
from expresslane.tokenizer import Tokenizer

_ids = itertools.count()


# generation_config.json's settings that become a request's defaults, as vLLM applies them
# (`--generation-config auto`): a request's own value always wins.
SAMPLING_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _eos(generation: dict) -> list[int]:
    eos = generation.get("eos_token_id")
    return eos if isinstance(eos, list) else ([] if eos is None else [eos])


def sampling_defaults(generation: dict) -> dict:
    """SamplingParams fields the model's generation config sets."""
    return {ours: generation[k] for k, ours in SAMPLING_DEFAULTS.items() if k in generation}


class RequestFactory:
    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        lanes: dict[str, Lane],
        max_model_len: int,
        tokenizer_dir: Path | None = None,
        threaded_masks: bool = False,
    ):
        tok_dir = tokenizer_dir or model_dir
        tok_json = tok_dir / "tokenizer.json"
        self.tokenizer = Tokenizer.from_dir(tok_dir) if tok_json.is_file() else None
        generation = _generation_config(model_dir)
        self.sampling_defaults = sampling_defaults(generation)
        eos = set(model_config.eos_token_ids) | set(_eos(generation))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = model_config.vocab_size
        self.lanes = lanes
        self.max_model_len = max_model_len
        self.grammars = (
            GrammarMatchers(tok_json.read_text(), self.vocab_size, sorted(eos), threaded_masks)
            if tok_json.is_file()
            else None
        )

    def make(self, sub: Submission) -> Request:
        """Validate and tokenize; raises InvalidRequestError."""
        lane, cache_salt, request_id = sub.lane, sub.cache_salt, sub.request_id
        if not is_served(self.lanes, lane):
            raise InvalidRequestError(
                f"the {lane!r} lane is not served here; lanes: {served(self.lanes)}",
                param="service_tier",
            )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", param="cache_salt")
        ids, text = tokenize(self.tokenizer, self.vocab_size, sub.prompt, sub.add_special_tokens)
        params = check_params(
            sub.params, len(ids), self.max_model_len, self.vocab_size, sub.clamp_max_tokens
        )
        req = Request(
            request_id if request_id is not None else f"req-{next(_ids)}",
            ids,
            params,
            lane=lane,
            eos_token_ids=self.eos_token_ids,
            prompt=text,
            max_tokens=params.max_tokens or self.max_model_len - len(ids),
            cache_salt=cache_salt,
            tenant=sub.tenant,
        )
        if self.tokenizer is not None:
            req.detok = TextState(self.tokenizer, req)
        if params.grammar is not None:
            if self.grammars is None:
                raise InvalidRequestError("constrained decoding needs the model's tokenizer.json")
            req.matcher = self.grammars.matcher(params.grammar)
        return req
