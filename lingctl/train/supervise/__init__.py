"""Supervising a training job: the launcher's agent, the hang watchdog, health checks, incidents and divergence."""
