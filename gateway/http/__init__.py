"""HTTP plumbing every route shares: who may call what (`access`), request bodies under their limits
(`bodies`), and the one table from exceptions to OpenAI or Anthropic error JSON (`errors`)."""
