# Solved when the test passes and was not edited.
set -e
python3 -m unittest -q test_hello
grep -q 'self.assertEqual(greet(), "hello, world")' test_hello.py
