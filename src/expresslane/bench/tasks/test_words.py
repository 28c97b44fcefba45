from words import count_words

assert count_words("one two three") == 3
assert count_words("  spaced   out  ") == 2, count_words("  spaced   out  ")
assert count_words("tab\tand\nnewline") == 3, count_words("tab\tand\nnewline")
assert count_words("") == 0, count_words("")
print("ok")
