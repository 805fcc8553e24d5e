# The verify stage (never in the agent's sandbox): the hidden tests in $BELAYER_TESTS run against the
# agent's /workspace with the task image's own interpreter in isolated mode (-I: no user site, no
# PYTHON* variables, nothing from the current directory in front of sys.path).
exec "$BELAYER_PYTHON" -I -m unittest discover -v -s "$BELAYER_TESTS" -t "$BELAYER_TESTS"
