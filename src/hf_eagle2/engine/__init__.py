"""The decode engine: one round loop (`decoding`) and what it alone uses (tree, drafter, verify, cache, target,
stopping, stats, n-gram branch, per-round budget, the stock-`generate` candidate generator). It imports only
`kernels`: no heads module, no training, evaluation or Hub I/O (the import-linter contract in pyproject.toml)."""
