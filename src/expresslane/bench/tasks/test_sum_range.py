from sum_range import sum_range

assert sum_range(1, 3) == 6, sum_range(1, 3)
assert sum_range(5, 5) == 5, sum_range(5, 5)
assert sum_range(-2, 2) == 0, sum_range(-2, 2)
print("ok")
