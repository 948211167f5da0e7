"""Continuous batching: the pure scheduling policy and the scheduler actor around it."""

from actors.scheduler.policy import PolicyConfig, SchedulingPolicy
from actors.scheduler.scheduler_actor import SchedulerActor

__all__ = ["PolicyConfig", "SchedulerActor", "SchedulingPolicy"]
