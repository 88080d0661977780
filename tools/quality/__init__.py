"""The quality yardstick: a small Llama trained here to attend to far tokens (``train``), the
documents it reads (``tasks``), its weights on disk (``model``) and scoring a document through a
KV cache (``evaluate``). `cxlemu bench quality` (``tools.bench.quality``) measures each KV mode
with it; `cxlemu quality train` rebuilds it."""
