"""fusedkit's ``@triton.jit`` code and nothing else, read in this order: ``helpers`` (offsets,
masks, conversions as PyTorch converts, TF32 splitting, ``tl.dot`` precisions),
``activations`` (the math of every activation and registry entry), ``elementwise`` (the one
kernel every registry entry runs), ``matmul`` (the tiled kernel and the epilogue every
matmul kernel shares) and ``matmul_tma`` (the Hopper kernel)."""
