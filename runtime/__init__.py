"""Matinee's actor runtime: actors, refs, supervision, death watch, timers, pipe-to-self, turns,
TCP remoting, registry.

A general framework: it never imports the serving stack built on it."""
from runtime.actor import Actor, ActorContext, Timer
from runtime.errors import ActorDead, AskTimeout, Escalated, RemoteError
from runtime.log import bound, configure_logging, get_logger
from runtime.loop import run
from runtime.messages import Piped, Terminated
from runtime.pipe import Pipe
from runtime.protocol import register_messages
from runtime.ref import ActorRef
from runtime.registry import InMemoryRegistry, Registry
from runtime.supervision import Supervision
from runtime.system import ActorSystem
from runtime.turns import Turns

register_messages(Terminated)

__all__ = [
    "Actor", "ActorContext", "ActorDead", "ActorRef", "ActorSystem", "AskTimeout", "Escalated",
    "InMemoryRegistry", "Pipe", "Piped", "Registry", "RemoteError", "Supervision", "Terminated", "Timer", "Turns",
    "bound", "configure_logging", "get_logger", "register_messages", "run",
]
