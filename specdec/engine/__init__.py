"""The engine: decoder and KV cache, the target pass, acceptance, draft trees, drafters, the budget planner and the speculation step. PyTorch and numpy; no Triton.
May import: specdec_wire, specdec.config, specdec.errors."""
