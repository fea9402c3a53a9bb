"""Agent loops a user writes: one state overridden, registered under a new name."""

from operators.rollout.agent_loop import AgentLoop, Conversation, register_agent_loop
from operators.rollout.conversation import LENGTH, STOP, RequestState


@register_agent_loop("tool_is_final")
class ToolIsFinal(AgentLoop):
    """The tool's answer is the conversation's last turn: no assistant turn after a successful call."""

    async def handle_tool_calling(self, conv: Conversation) -> RequestState:
        state = await super().handle_tool_calling(conv)
        if state is RequestState.GENERATING and conv.traj.tool_successes:
            return self.end(conv, STOP)
        return state


@register_agent_loop("hinted")
class Hinted(AgentLoop):
    """A user turn with a hint before the model's first turn."""

    async def handle_pending(self, conv: Conversation) -> RequestState:
        state = await super().handle_pending(conv)
        if not self.append_turns(conv.traj, [{"role": "user", "content": "add"}]):
            return self.end(conv, LENGTH)
        return state
