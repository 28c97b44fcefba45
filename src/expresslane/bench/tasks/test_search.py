from search import find

items = [1, 3, 5, 7, 9]
for i, x in enumerate(items):
    assert find(items, x) == i, (x, find(items, x))
assert find(items, 4) == -1
assert find([], 1) == -1
assert find([2], 2) == 0, find([2], 2)
print("ok")
