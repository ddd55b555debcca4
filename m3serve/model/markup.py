"""The fixed strings of MiniMax-M3's chat markup that code outside the template must know: the
thinking tags around reasoning and the namespace that prefixes every tool-call tag. No torch here:
the API process imports it."""
from __future__ import annotations

THINK_OPEN = "<mm:think>"
THINK_CLOSE = "</mm:think>"
NAMESPACE = "]<]minimax[>["          # prefixes <tool_call>, <invoke ...> and each argument element
