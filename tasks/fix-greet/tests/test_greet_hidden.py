"""Hidden from the agent: copied in for the verify stage only."""

import os
import sys
import unittest

# Last on the path: nothing in the agent's repository can shadow the standard library.
sys.path.append(os.environ.get("BELAYER_WORKSPACE", "/workspace"))

from hello import greet


class HiddenGreetTest(unittest.TestCase):
    def test_hidden_greeting_is_exact(self):
        self.assertEqual(greet(), "hello, world")

    def test_hidden_greeting_is_a_plain_str(self):
        self.assertIs(type(greet()), str)


if __name__ == "__main__":
    unittest.main()
