from fizzbuzz import fizzbuzz

assert fizzbuzz(1) == "1"
assert fizzbuzz(9) == "Fizz"
assert fizzbuzz(10) == "Buzz"
assert fizzbuzz(15) == "FizzBuzz", fizzbuzz(15)
assert fizzbuzz(45) == "FizzBuzz", fizzbuzz(45)
print("ok")
