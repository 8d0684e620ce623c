"""The tools a host offers its agents: callables with a name, a schema and a timeout."""

from __future__ import annotations

import dataclasses
import inspect
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import msgspec

from stalwart.errors import ToolRegistrationError
from stalwart.events import ToolSpec

from ._schema import check_explicit, docstring_summary, schema_of, signature_of

F = TypeVar("F", bound=Callable[..., Any])

#: What every provider accepts as a tool name (OpenAI's rule; Anthropic's is the same).
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
DEFAULT_TIMEOUT_MS = 30_000
#: The most a call's result may hold, in UTF-8 bytes, unless the tool or its registry
#: says otherwise: about 14,000 tokens of English, so the calls of a step (4 at once by
#: default) take under half of a 128,000-token window; more is cut, with a marker.
DEFAULT_MAX_RESULT_BYTES = 50_000
#: ``reconcile(idempotency_key, arguments)``, sync or async: after a crash cut a call
#: short, the output of its effect if it happened (made text like a result), else None.
Reconcile = Callable[[str, dict[str, Any]], object]


@dataclass(frozen=True, slots=True)
class Tool:
    """One registered tool.

    ``arguments`` is the msgspec Struct built from the signature that validates a call's
    arguments; ``extra_keywords`` says the callable takes ``**kwargs``, which receive the
    arguments the signature does not name, each converted to ``extra_type`` (its hint).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    is_async: bool
    timeout_ms: int
    needs_confirmation: bool
    arguments: type[msgspec.Struct]
    extra_keywords: bool
    extra_type: Any = Any
    custom: bool = False
    #: the most a result (or a ToolError's message) may hold, in UTF-8 bytes: the rest is
    #: cut, with a marker saying how much (None: no limit)
    max_result_bytes: int | None = None
    #: after a crash cut a call short, whether its effect happened (see :data:`Reconcile`)
    reconcile: Reconcile | None = None

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)


class ToolRegistry:
    """The tools an agent may call, by name, in registration order.

    ::

        tools = ToolRegistry()

        @tools.register(timeout_ms=5_000)
        def search(query: str, limit: int = 10) -> list[str]:
            \"\"\"Search the documents.\"\"\"
            ...

        tools.register(fetch, name="fetch_page", needs_confirmation=True)
    """

    def __init__(self, *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        """``max_result_bytes``: the limit of a result for the tools registered here
        that do not name their own (see :meth:`register`)."""
        self.max_result_bytes = _checked_limit(max_result_bytes, None)
        self._tools: dict[str, Tool] = {}
        self._reserved: dict[str, str] = {}  # name -> who has it
        # a host registers while Agents read (tools registered later are offered from the
        # next model call on): registering is one step, and readers iterate a copy
        self._lock = threading.Lock()

    def reserve(self, names: Iterable[str], owner: str) -> None:
        """Refuse ``names`` from now on (the runtime's built-in tools, ``owner`` says
        whose). ToolRegistrationError (``field="name"``) when one is registered already."""
        with self._lock:
            for name in names:
                if name in self._tools:
                    raise ToolRegistrationError(
                        f"a tool named {name!r} is already registered, but {owner} uses that name",
                        field="name",
                        tool=name,
                    )
                self._reserved[name] = owner

    def _add(self, tool: Tool) -> None:
        with self._lock:
            self._check_free(tool.name)
            self._tools[tool.name] = tool

    def _check_free(self, name: str) -> None:
        owner = self._reserved.get(name)
        if owner is not None:
            raise ToolRegistrationError(
                f"the tool name {name!r} belongs to {owner}; choose another",
                field="name",
                tool=name,
            )
        if name in self._tools:
            raise ToolRegistrationError(
                f"a tool named {name!r} is already registered", field="name", tool=name
            )

    @overload
    def register(
        self,
        fn: F,
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: dict[str, Any] | None = None,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        needs_confirmation: bool = False,
        reconcile: Reconcile | None = None,
        max_result_bytes: int | None = None,
    ) -> F: ...

    @overload
    def register(
        self,
        fn: None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: dict[str, Any] | None = None,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        needs_confirmation: bool = False,
        reconcile: Reconcile | None = None,
        max_result_bytes: int | None = None,
    ) -> Callable[[F], F]: ...

    def register(
        self,
        fn: F | None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: dict[str, Any] | None = None,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        needs_confirmation: bool = False,
        reconcile: Reconcile | None = None,
        max_result_bytes: int | None = None,
    ) -> F | Callable[[F], F]:
        """Register ``fn`` (sync or async) and return it unchanged; a decorator without it.

        The name defaults to the function's, the description to its docstring's first
        paragraph, and the JSON schema is derived from its type hints and defaults unless
        ``parameters`` gives one. A result longer than ``max_result_bytes`` (UTF-8; the
        registry's limit when None) is cut, with a marker. Raises
        :class:`ToolRegistrationError` for a name that is not provider-safe
        (``^[a-zA-Z0-9_-]{1,64}$``) or already taken, a signature JSON cannot call, or a
        timeout or result limit that is not a positive integer.
        """

        limit = self.max_result_bytes if max_result_bytes is None else max_result_bytes

        def add(target: F) -> F:
            tool = build_tool(
                target,
                name=name,
                description=description,
                parameters=parameters,
                timeout_ms=timeout_ms,
                needs_confirmation=needs_confirmation,
                max_result_bytes=limit,
            )
            if reconcile is not None:
                tool = dataclasses.replace(tool, reconcile=reconcile)
            self._add(tool)
            return target

        return add if fn is None else add(fn)

    def register_custom(
        self,
        name: str,
        *,
        description: str = "",
        parameters: dict[str, Any] | None = None,
        max_result_bytes: int | None = None,
    ) -> None:
        """Declare a tool the host implements outside the agent: a call to it pauses the
        session (``requires_action``) until ``submit_tool_result`` gives its output, which
        the model reads cut to ``max_result_bytes`` (None: the registry's limit) as a
        tool's own result is."""
        limit = self.max_result_bytes if max_result_bytes is None else max_result_bytes
        _checked_limit(limit, name)

        def host_implemented(**arguments: Any) -> Any:
            raise ToolRegistrationError(
                f"custom tool {name!r} runs in the host, not in the agent",
                field="custom",
                tool=name,
            )

        schema = parameters or {"type": "object", "properties": {}}
        tool = build_tool(host_implemented, name=name, description=description, parameters=schema)
        self._add(dataclasses.replace(tool, custom=True, max_result_bytes=limit))

    def get(self, name: str) -> Tool | None:
        """The tool registered as ``name``, or None."""
        return self._tools.get(name)

    def specs(self) -> tuple[ToolSpec, ...]:
        """Every tool's spec, in registration order, for a provider request."""
        return tuple(tool.spec for tool in tuple(self._tools.values()))

    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(tuple(self._tools.values()))

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"ToolRegistry({list(self._tools)!r})"


def build_tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    needs_confirmation: bool = False,
    max_result_bytes: int | None = None,
) -> Tool:
    """A :class:`Tool` for ``fn``, checked (see :meth:`ToolRegistry.register`); its
    results are not cut unless ``max_result_bytes`` is given."""
    tool_name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
    if not isinstance(tool_name, str) or not NAME_PATTERN.fullmatch(tool_name):
        raise ToolRegistrationError(
            f"tool name {tool_name!r} is not allowed: use 1 to 64 letters, digits, '_' or '-'",
            field="name",
            tool=str(tool_name),
        )
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0:
        raise ToolRegistrationError(
            f"tool {tool_name!r}: timeout_ms must be a positive integer, got {timeout_ms!r}",
            field="timeout_ms",
            tool=tool_name,
        )
    if max_result_bytes is not None:
        _checked_limit(max_result_bytes, tool_name)
    signature = signature_of(fn, tool_name)
    if parameters is None:
        schema = schema_of(signature, tool_name)
    else:
        schema = check_explicit(parameters, tool_name)
        try:
            schema_of(signature, tool_name)
        except ToolRegistrationError:  # types msgspec cannot check: check names only
            signature = signature_of(fn, tool_name, loose=True)
    return Tool(
        name=tool_name,
        description=docstring_summary(fn) if description is None else description,
        parameters=schema,
        fn=fn,
        is_async=_is_async(fn),
        timeout_ms=timeout_ms,
        needs_confirmation=needs_confirmation,
        arguments=signature.arguments,
        extra_keywords=signature.extra_keywords,
        extra_type=signature.extra_type,
        max_result_bytes=max_result_bytes,
    )


def _checked_limit(limit: object, tool: str | None) -> int:
    """``limit`` when it is a positive integer; ToolRegistrationError otherwise."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        whose = "a registry" if tool is None else f"tool {tool!r}"
        raise ToolRegistrationError(
            f"{whose}: max_result_bytes must be a positive integer, got {limit!r}",
            field="max_result_bytes",
            tool=tool,
        )
    return limit


def _is_async(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - a callable object's method
    return call is not None and not inspect.isfunction(fn) and inspect.iscoroutinefunction(call)
