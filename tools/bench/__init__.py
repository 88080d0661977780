"""Probes of the timed data path, in the manner of Intel MLC: latency (dependent pointer
chase) and bandwidth (streams of transfers), against a served device or a private one."""
