"""What the gateway knows of the policy model: its chat template and tokenizer (`tokenization`), its
output parsers (`parsers`, `streaming`), and its weight versions (`weights`)."""
