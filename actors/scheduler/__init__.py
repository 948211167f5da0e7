"""Continuous batching: the pure scheduler and the actor around it."""

from actors.scheduler.config import SchedulerConfig
from actors.scheduler.scheduler import Scheduler
from actors.scheduler.scheduler_actor import SchedulerActor

__all__ = ["SchedulerConfig", "SchedulerActor", "Scheduler"]
