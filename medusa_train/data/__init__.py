"""Training rows: formats, chat templates, tokenized and packed datasets, prompt pools, prompts the target writes
itself, and distillation (the target answering them)."""
