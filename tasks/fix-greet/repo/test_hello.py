import unittest

from hello import greet


class GreetTest(unittest.TestCase):
    def test_greet(self):
        self.assertEqual(greet(), "hello, world")


if __name__ == "__main__":
    unittest.main()
