"""The host side of fusedkit's kernels, read in this order: ``configs`` (tile and tuning
tables, each with its measured reason), ``layout`` (broadcast and stride planning), ``launch``
(kept launches of compiled kernels, the caches and ``clear_caches``), ``native`` (the C++
launch table, on by default, and its build), ``elementwise`` and ``matmul_tma`` / ``matmul`` (validate, plan, launch,
keep), ``codegen`` (compiling for a GPU target on any machine). Nothing here imports
autograd or the dispatcher."""
