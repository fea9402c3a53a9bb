"""Environments and simulated users: whatever answers an assistant turn that calls no tool.

An :class:`Environment` is made per conversation from the sample's
``interaction_kwargs`` (verl's ``extra_info`` layout). ``reset`` may give a
first observation (appended as a user turn before the first generation);
``step(action)`` takes the assistant's text and returns an
:class:`EnvStep`: the next observation (a user turn), a reward, ``done``, and
``info``. ``info["spawn"]`` may hold conversations (lists of messages) for the
loop to run as extra trajectories of the same rollout (a sub-agent); an
environment that spawns declares how many trajectories each rollout yields in
``trajectories`` so the batch keeps its shape.

A simulated user is an :class:`Interaction`: an environment whose step is
``respond(messages)``::

    class Teacher(Interaction):
        async def respond(self, messages):
            right = messages[-1]["content"].strip() == self.kwargs["ground_truth"]
            return EnvStep("" if right else "try again", reward=float(right), done=right)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EnvStep:
    """One environment step: the observation for the model, a reward, whether it is over, extras."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """A task that is not a tool call: reset → observation, step(action) → :class:`EnvStep`.

    ``kwargs`` are the sample's ``interaction_kwargs``; ``role`` is the role
    observations are shown as (``"user"``).
    """

    #: trajectories each rollout yields (1, plus the conversations it spawns)
    trajectories: int = 1
    role: str = "user"

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.messages: list[dict[str, Any]] = []

    async def reset(self) -> str | None:
        """The first observation (a user turn before the first generation), or ``None``."""
        return None

    @abc.abstractmethod
    async def step(self, action: str) -> EnvStep:
        """The assistant's text → what happens next."""

    async def close(self) -> None:
        """Release what the environment holds."""


class Interaction(Environment):
    """A simulated user: sees the whole conversation and plays the next user turn."""

    async def step(self, action: str) -> EnvStep:
        return await self.respond(self.messages)

    @abc.abstractmethod
    async def respond(self, messages: list[dict[str, Any]]) -> EnvStep:
        """The conversation so far (the assistant's turn last) → the user's reply."""
