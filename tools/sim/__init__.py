"""The serving simulator: a vLLM-like engine on the firmware model's simulated clock.

    hardware   model shapes, accelerators (published figures), links (the emulator's presets),
               the step cost: a roofline, or a linear model fitted to measured step times
    workload   closed-loop client scripts: the seed's fixed sequences, multi-turn sessions with
               shared prefixes, cxlemu bench serve's clients, JSON-lines trace files
    engine     the discrete-event engine: vLLM v1's scheduler (chunked prefill, prefix cache,
               preemption by recompute or swap) and the offload tier (firmware_model's policies
               and DMA scheduler on the one link model)
    run        one point (model, accelerator, workload, mode, concurrency) -> metrics
    validate   the simulator against a `cxlemu bench serve` run (its step costs fitted)
    sweep      many points as tasks on a Dask cluster; tables and plots
"""
