"""JSON answers: chats where the user asks for an object as JSON and the assistant replies with
one JSON object and nothing else (what JSON mode, `response_format: json_object`, expects).

Without them every JSON object the demo model has seen is a tool call, so JSON mode makes it
write `{"name": "list_dir", "arguments": ...}` whatever was asked. The keys come from the
request when it names them (listed, typed, or shown in an example object) and otherwise from
the kind of object (a person has a name and an age), so the answer copies them from the prompt.
Half of the objects describe a real train file (its path, line count, functions, classes),
the rest are made up from small pools of names, words and numbers.
"""

from __future__ import annotations

import json
import random

FIRST = "Ada Alan Grace Linus Guido Barbara Ken Dennis Margaret Edsger Donald Frances Tim Anita"
LAST = "Lovelace Turing Hopper Torvalds Rossum Liskov Thompson Ritchie Hamilton Knuth Allen Lee"
CITIES = "Paris Berlin Tokyo Lima Oslo Cairo Lagos Delhi Quito Rome Seoul Dublin Austin Porto"
COUNTRIES = "France Germany Japan Peru Norway Egypt Nigeria India Ecuador Italy Korea Ireland"
COLORS = "red green blue black white orange purple yellow"
LANGUAGES = "Python C Rust Go Java Haskell Lua Ruby"

TYPE_WORDS = {
    "string": "a string",
    "integer": "an integer",
    "boolean": "a boolean",
    "array": "a list of strings",
}
# kind -> its default fields (name, type): the keys used when the request names none
KINDS = {
    "person": [("name", "string"), ("age", "integer")],
    "user": [("username", "string"), ("id", "integer"), ("active", "boolean")],
    "city": [("name", "string"), ("country", "string"), ("population", "integer")],
    "book": [("title", "string"), ("author", "string"), ("year", "integer")],
    "task": [("title", "string"), ("done", "boolean"), ("priority", "integer")],
    "point": [("x", "integer"), ("y", "integer")],
    "color": [("name", "string"), ("hex", "string")],
    "project": [("name", "string"), ("language", "string"), ("stars", "integer")],
    "event": [("name", "string"), ("city", "string"), ("year", "integer")],
    "employee": [("name", "string"), ("age", "integer"), ("email", "string")],
}
EXTRA_FIELDS = [
    ("email", "string"),
    ("city", "string"),
    ("age", "integer"),
    ("id", "integer"),
    ("tags", "array"),
    ("active", "boolean"),
    ("score", "integer"),
    ("language", "string"),
    ("count", "integer"),
    ("name", "string"),
]
ASK_DEFAULT = [
    "Give me {kind} as JSON.",
    "Return {kind} as a JSON object.",
    "Make up {kind} and answer in JSON.",
    "Reply with a JSON object describing {kind}.",
    "Invent {kind}. Output JSON only.",
]
ASK_KEYS = [
    "Give me {kind} as JSON with the keys {keys}.",
    "Return a JSON object for {kind} with {typed}.",
    "Reply in JSON: {kind} with the fields {keys}.",
    "Describe {kind} as a JSON object. Use the keys {keys}.",
    "Make up {kind}. Answer with JSON that has {typed}.",
]
ASK_EXAMPLE = [
    "Give me another {kind_bare} as JSON, like {example}.",
    "Reply with a JSON object in this shape: {example}. Make up {kind}.",
]
ASK_FILE = [
    "Describe the file {p} as JSON with the keys {keys}.",
    "Return JSON for {p} with {typed}.",
    "Summarize {p} as a JSON object: {keys}.",
]
SYSTEM_JSON = [
    "You answer with a single JSON object.",
    "Reply in JSON only.",
    "You are a helpful assistant that outputs JSON.",
]


def _phrase(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _quote(rng: random.Random, key: str) -> str:
    return rng.choice(['"{}"', "`{}`", "{}"]).format(key)


def _value(rng: random.Random, key: str, kind: str, words: list[str]):
    if kind == "integer":
        return (
            rng.randint(18, 90)
            if key == "age"
            else rng.choice([rng.randint(0, 9), rng.randint(10, 999), rng.randint(1000, 2025)])
        )
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return rng.sample(words, rng.randint(1, 3))
    pools = {
        "name": FIRST,
        "username": FIRST,
        "author": FIRST,
        "city": CITIES,
        "country": COUNTRIES,
        "color": COLORS,
        "language": LANGUAGES,
    }
    if key in ("name", "author") and rng.random() < 0.5:
        return f"{rng.choice(FIRST.split())} {rng.choice(LAST.split())}"
    if key == "email":
        return f"{rng.choice(FIRST.split()).lower()}@example.com"
    if key == "hex":
        return f"#{rng.randrange(1 << 24):06x}"
    if key in pools:
        return rng.choice(pools[key].split())
    return " ".join(rng.sample(words, rng.randint(1, 3))).capitalize()


def _ask(rng: random.Random, asks: list[str], fields, **slots) -> str:
    keys = _phrase([_quote(rng, k) for k, _ in fields])
    typed = _phrase([f"{_quote(rng, k)} ({TYPE_WORDS[t]})" for k, t in fields])
    return rng.choice(asks).format(keys=keys, typed=typed, **slots)


def made_up(rng: random.Random, words: list[str]) -> tuple[str, dict]:
    """A request for an invented object and the object."""
    kind = rng.choice(sorted(KINDS))
    fields = list(KINDS[kind])
    style = rng.choices(["default", "keys", "example"], weights=[3, 5, 2])[0]
    if style != "default" and rng.random() < 0.5:
        extra = [f for f in EXTRA_FIELDS if f[0] not in {k for k, _ in fields}]
        fields += rng.sample(extra, rng.randint(1, 2))
        rng.shuffle(fields)
    obj = {k: _value(rng, k, t, words) for k, t in fields}
    if kind == "city":
        obj["name"] = rng.choice(CITIES.split())
    kind = ("an " if kind[0] in "aeio" else "a ") + kind
    if style == "default":
        return rng.choice(ASK_DEFAULT).format(kind=kind), obj
    if style == "keys":
        return _ask(rng, ASK_KEYS, fields, kind=kind), obj
    example = json.dumps({k: _value(rng, k, t, words) for k, t in fields})
    bare = kind.split(" ", 1)[1]
    return rng.choice(ASK_EXAMPLE).format(kind=kind, kind_bare=bare, example=example), obj


def about_file(rng: random.Random, path: str, source: str, defs) -> tuple[str, dict]:
    """A request for facts of a real file, answered from the file."""
    facts = {
        "path": ("string", path),
        "lines": ("integer", source.count("\n") + 1),
        "functions": ("array", [n for k, n, _ in defs if k == "function"][:8]),
        "classes": ("array", [n for k, n, _ in defs if k == "class"][:8]),
        "name": ("string", path.rsplit("/", 1)[-1]),
    }
    keys = ["path"] + rng.sample(["lines", "functions", "classes", "name"], rng.randint(1, 3))
    fields = [(k, facts[k][0]) for k in keys]
    p = f"`{path}`" if rng.random() < 0.5 else path
    return _ask(rng, ASK_FILE, fields, p=p), {k: facts[k][1] for k in keys}


def json_answer(rng: random.Random, factory) -> tuple[list[dict], None]:
    """One chat: an optional JSON-only system prompt, the request, the object as the reply."""
    if rng.random() < 0.35:
        rel = rng.choice(factory.files)
        path = ("Lib/" + rel) if rng.random() < 0.7 else rel
        ask, obj = about_file(rng, path, factory.sources[rel], factory.defs[rel])
    else:
        ask, obj = made_up(rng, factory.name_words)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_JSON)})
    messages.append({"role": "user", "content": ask})
    messages.append({"role": "assistant", "content": json.dumps(obj)})
    return messages, None
