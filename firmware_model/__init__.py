"""The controller's firmware logic, pure: hotness (CHMU), block pool, eviction, prefetch, DMA
scheduling, telemetry. Time is passed in (a :class:`~firmware_model.clock.Clock` or ``now``);
no I/O, no threads, no wall clock. Imports numpy and simpy, nothing of cxlemu's.
"""
