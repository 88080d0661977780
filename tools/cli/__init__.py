"""The `cxlemu` command line, shaped like ndctl's `cxl`."""
