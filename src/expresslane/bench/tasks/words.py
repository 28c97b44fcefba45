"""Word counts."""


def count_words(text: str) -> int:
    """The number of words in text, separated by any run of whitespace."""
    return len(text.split(" "))
