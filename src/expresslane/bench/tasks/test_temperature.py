from temperature import to_celsius

assert to_celsius(32) == 0, to_celsius(32)
assert abs(to_celsius(212) - 100) < 1e-9, to_celsius(212)
assert abs(to_celsius(-40) + 40) < 1e-9, to_celsius(-40)
print("ok")
