"""The serving simulator: a vLLM-like engine on the firmware model's simulated clock. A library:
it imports nothing else of ``tools`` (the CLI is ``tools/cli/cmd_sim.py``).

    modes      the serving modes (one table: the simulator's, ``cxlemu bench serve``'s)
    hardware   model shapes, accelerators (published figures), links (the emulator's presets),
               tensor parallelism (NVLink all-reduces), the step cost: a roofline, or a linear model
               fitted to measured step times
    workload   closed-loop clients: the seed's fixed sequences, multi-turn sessions with shared
               prefixes, ``cxlemu bench serve``'s clients, JSON-lines trace files
    profile    step times from Vidur's measured operators (``data/vidur``), the roofline elsewhere
    check      both cost models beside published first-token latencies
    metrics    TTFT, TPOT, throughput: one definition for the simulator and the bench
    engine     the discrete-event engine: vLLM v1's scheduler (chunked prefill, prefix cache,
               preemption by recompute or swap) and the offload tier (firmware_model's policies
               and DMA scheduler on the one link model)
    run        one point (model, accelerator, workload, mode, concurrency) -> metrics
    validate   the simulator against a `cxlemu bench serve` run (its step costs fitted)
    grid       a sweep's points; sweep: them as tasks on a Dask cluster; pricing: $/M tokens;
    export     JSON and CSV rows; plots: the serving figure
"""
