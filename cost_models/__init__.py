"""Cost models: compute, communication, memory and pipeline schedules."""
