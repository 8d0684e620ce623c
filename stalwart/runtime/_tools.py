"""The built-in ``spawn_subagent`` tool and a session's own tool registry."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, cast

import anyio.to_thread

from stalwart._aio import wait_on_own_thread
from stalwart.errors import SpawnRefusedError, ToolError
from stalwart.events import TaskClass
from stalwart.tools import Tool, ToolRegistry, ToolSpec

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["BUILTIN_TOOLS", "SPAWN_TOOL", "SessionTools", "spawn_tool_fn"]

#: The built-in tool an agent with ``subagents = true`` offers its model.
SPAWN_TOOL = "spawn_subagent"

#: Every name a session's built-in tools may use (``spawn_subagent``, the draft tools with
#: a committer, the DAG context engine's ``ctx_*``): the runtime's registry refuses them.
BUILTIN_TOOLS = frozenset(
    {
        SPAWN_TOOL,
        *("draft_write", "draft_read", "draft_list", "draft_commit"),
        *("ctx_search", "ctx_inspect", "ctx_expand"),
    }
)


class SessionTools(ToolRegistry):
    """A session's tools: the runtime's registry (read live) plus its own built-ins."""

    def __init__(self, base: ToolRegistry, *own: Tool) -> None:
        super().__init__()
        self._base = base
        self._own = {tool.name: tool for tool in own}

    def get(self, name: str) -> Tool | None:
        return self._own.get(name) or self._base.get(name)

    def specs(self) -> tuple[ToolSpec, ...]:
        # a built-in shadows a host tool of its name (a registry given to the runtime
        # may hold one): a request never declares one name twice
        base = (spec for spec in self._base.specs() if spec.name not in self._own)
        return (*base, *(tool.spec for tool in self._own.values()))

    def names(self) -> tuple[str, ...]:
        return (*(name for name in self._base.names() if name not in self._own), *self._own)

    def __contains__(self, name: object) -> bool:
        return name in self._own or name in self._base

    def __iter__(self) -> Iterator[Tool]:
        base = (tool for tool in self._base if tool.name not in self._own)
        return iter((*base, *self._own.values()))

    def __len__(self) -> int:
        return len(self.names())


def spawn_tool_fn(rt: Runtime, session_id: str, agent: str) -> Callable[..., Awaitable[str]]:
    """The ``spawn_subagent`` tool of one session: spawn, wait, answer with the result."""

    async def spawn_subagent(
        task: str,
        task_class: str | None = None,
        custom_timeout_ms: int | None = None,
        reason: str | None = None,
        max_steps: int | None = None,
    ) -> str:
        """Hand a self-contained task to a sub-agent and wait for its answer.

        Every spawn needs a time limit: a task_class (formatting: 2 min, code: 5 min,
        research: 10 min, deep: 15 min), or custom_timeout_ms with a reason saying why.
        Returns the sub-agent's answer, or a short notice if it did not complete.
        """
        spawn = partial(
            rt.spawn,
            session_id,
            task,
            task_class=cast(TaskClass | None, task_class),
            custom_timeout_ms=custom_timeout_ms,
            reason=reason,
            max_steps=max_steps,
            agent=agent,
            announce=False,  # the answer goes back through the parent's model
        )
        try:
            handle = await anyio.to_thread.run_sync(spawn)
        except SpawnRefusedError as exc:
            raise ToolError(str(exc), error_class="spawn_refused") from exc
        ended = await wait_on_own_thread(handle.result)  # for the run's whole life
        return ended.result if ended.outcome == "succeeded" else ended.notice

    return spawn_subagent
