"""The command lines of `cxlemu bench ...`: one module per bench, each with ``register(bench)``
(its parser, on the subparsers ``tools/cli/cmd_bench.py`` hands it) and its handler (the flags
checked, the library's measurement called with plain values, its result printed). What they
measure is in ``tools.bench``, ``tools.trace.bench`` and ``tools.monitor.bench``."""
