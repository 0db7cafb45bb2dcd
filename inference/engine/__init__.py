"""The engine: every file one generation touches, and nothing that only measures it.

The ladder, bottom up (each rung imports only the rungs below it):

    tree       the draft tree: topology, ancestor mask, position ids, static and dynamic tree search
    kernels    CPU kernel choices (oneDNN linears, the tree-attention path)
    kv         the target's cache: create, crop, compact to the accepted path
    verify     one target forward over a tree; greedy, lossless and typical acceptance
    support    which targets can verify a tree (checked from the config, then proven on a small tree)
    calibrate  acceptance probabilities learned online, for the per-step trim on a CPU
    choice     which way a CPU step drafts (the default, heads alone, lookup alone, none), by tokens/s earned
    drafters   heads, n-gram lookup, bigram, and the hybrid that grafts lookup onto the heads' tree
    compiled   the verify forward as a static-cache graph (`compile=True`)
    budget     the tree budget: verify and drafting timings, kept per machine, and their drift
    generator  `SpeculativeGenerator`: prefill -> speculative_step -> generate
"""
