"""The frozen target: loading it (hub name, local directory or GGUF), reading its hidden states, the cache of those
states, sharding it over processes, and filling the cache from vLLM."""
