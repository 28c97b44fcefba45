"""Argument types for the command line: each checks a value when the flags are parsed, so a bad
one is a single `expresslane CMD: error: ...` line and exit status 2, before anything loads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expresslane import names

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DTYPES = ("auto", *names.DTYPES)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block above them)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def fail(prog: str, message: str) -> int:
    """Report an error found after parsing the way the parser does; returns exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def port(text: str) -> int:
    value = _number(text, int, "a port number")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: use 1 to 65535")
    return value


def model_dir_problem(spec: str) -> str | None:
    """Why `spec` (a model directory, a .gguf file or a Hub name) cannot be served, or None."""
    from expresslane.model_source import model_problem

    return model_problem(spec)


def model_dir(text: str) -> str:
    problem = model_dir_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return text


def parse_lane_flags(flags: list[str]) -> dict:
    """['ultrafast.max_batch=2', ...] -> {'ultrafast': {'max_batch': 2}}; values are TOML. A
    dotted setting is a table's: 'ultrafast.promise.tokens_per_s=40'."""
    lanes: dict = {}
    for flag in flags:
        name, eq, value = flag.partition("=")
        lane, dot, setting = name.partition(".")
        if not (eq and dot and lane and setting):
            raise ValueError(f"{flag!r}: expected LANE.SETTING=VALUE")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare word, e.g. auto
        table = lanes.setdefault(lane, {})
        *tables, last = setting.split(".")
        for key in tables:
            table = table.setdefault(key, {})
        table[last] = parsed
    return lanes


def parse_speculative_flag(value: str | None) -> dict | None:
    """'ngram' / 'suffix' / 'draft' / a TOML inline table -> the `speculative` option."""
    if value is None:
        return None
    if value.strip().startswith("{"):
        try:
            return tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{value!r} is not a TOML table: {e}") from None
    return {"method": value}


def lane_setting(text: str) -> str:
    try:
        parse_lane_flags([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def speculative(text: str) -> str:
    try:
        parse_speculative_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def origins(text: str) -> list[str]:
    """`*`, `http://a,http://b` or a JSON list (as vLLM takes it)."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {e}") from None
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [o.strip() for o in text.split(",") if o.strip()]
