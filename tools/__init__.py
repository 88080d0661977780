"""cxlemu's user-facing tools: the `cxlemu` command, the monitor, benchmarks and the demo."""
