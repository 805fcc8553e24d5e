"""Adapters that run real agent harnesses against a session's base URL, unchanged: ``base`` (the seam),
``claude_code``, ``mini_swe_agent``, and ``scripted_engine`` (a scripted policy for their tests)."""
