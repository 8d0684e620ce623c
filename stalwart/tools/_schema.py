"""A callable's arguments as a msgspec Struct, and that Struct as a provider-safe JSON schema.

The Struct (``msgspec.defstruct``) is built once, at registration, from the signature's
type hints and defaults; it both validates a model's arguments (``msgspec.convert``) and
yields the JSON schema the model sees, so the two can never disagree. Providers want one
self-contained object schema, so ``$defs`` are inlined, except for recursive types, whose
definitions stay under ``$defs`` at the root.
"""

from __future__ import annotations

import copy
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from stalwart.errors import ToolRegistrationError

_MUTABLE = (list, dict, set, bytearray)
_DEFS = "#/$defs/"


class Signature(msgspec.Struct, frozen=True):
    """What registration learned from a callable's signature."""

    arguments: type[msgspec.Struct]
    extra_keywords: bool
    #: the type of each argument ``**kwargs`` takes: its hint (``Any`` without one)
    extra_type: Any = Any


def signature_of(fn: Callable[..., Any], name: str, *, loose: bool = False) -> Signature:
    """The arguments Struct of ``fn``; raises ToolRegistrationError for what JSON cannot call.

    ``loose`` types every parameter as ``Any`` (names and required ones are still checked).
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ToolRegistrationError(
            f"tool {name!r}: cannot read the signature of {fn!r}", field="signature", tool=name
        ) from exc
    hints = {} if loose else _hints(fn, name)
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    extra: Any = None  # the **kwargs hint, if there is such a parameter
    for parameter in signature.parameters.values():
        kind = parameter.kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            extra = hints.get(parameter.name, Any)
            continue
        if kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise ToolRegistrationError(
                f"tool {name!r}: parameter {parameter.name!r} is {kind.description}; a model"
                " passes arguments by name, so every parameter must accept a keyword",
                field="signature",
                tool=name,
            )
        hint = hints.get(parameter.name, Any)
        if parameter.default is inspect.Parameter.empty:
            fields.append((parameter.name, hint))
        else:
            fields.append((parameter.name, hint, _default(parameter.default)))
    try:
        arguments = msgspec.defstruct(
            f"{name}_arguments", fields, kw_only=True, forbid_unknown_fields=extra is None
        )
    except (TypeError, ValueError, RuntimeError) as exc:  # '__x', '__dict__', '__slots__'
        raise ToolRegistrationError(
            f"tool {name!r}: a parameter name cannot be used for an argument ({exc});"
            " names such as '__x', '__dict__' or '__slots__' are not allowed: rename it",
            field="signature",
            tool=name,
        ) from exc
    if extra is None:
        return Signature(arguments=arguments, extra_keywords=False)
    return Signature(arguments=arguments, extra_keywords=True, extra_type=extra)


def _hints(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__call__  # a callable object
    try:
        return typing.get_type_hints(target, include_extras=True)
    except Exception as exc:
        raise ToolRegistrationError(
            f"tool {name!r}: cannot resolve the type hints of {fn!r} ({exc})",
            field="signature",
            tool=name,
        ) from exc


def _default(value: Any) -> Any:
    if isinstance(value, _MUTABLE) and value:
        return msgspec.field(default_factory=lambda: copy.deepcopy(value))
    return value


def schema_of(signature: Signature, name: str) -> dict[str, Any]:
    """The self-contained JSON schema of a signature's arguments (``type: object`` at the
    top); a typed ``**kwargs`` gives its type as ``additionalProperties``."""
    try:
        (top, extra), defs = msgspec.json.schema_components(
            (signature.arguments, signature.extra_type), ref_template=_DEFS + "{name}"
        )
    except (TypeError, ValueError) as exc:
        raise ToolRegistrationError(
            f"tool {name!r}: a parameter's type has no JSON schema ({exc});"
            " give parameters= explicitly",
            field="parameters",
            tool=name,
        ) from exc
    if signature.extra_keywords and signature.extra_type is not Any:
        top = {**top, "additionalProperties": extra}
    return inline_defs({**top, "$defs": defs} if defs else top)


def inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every ``$ref`` replaced by its definition (recursive ones kept)."""
    defs: dict[str, Any] = schema.get("$defs", {})
    recursive: set[str] = set()

    def resolve(node: Any, stack: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(item, stack) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_DEFS):
            target = ref.removeprefix(_DEFS)
            if target in stack or target in recursive:
                recursive.add(target)
                return node
            rest = {key: resolve(value, stack) for key, value in node.items() if key != "$ref"}
            return {**resolve(defs[target], (*stack, target)), **rest}
        return {key: resolve(value, stack) for key, value in node.items()}

    top = {key: value for key, value in schema.items() if key != "$defs"}
    root_ref = top.pop("$ref", None)
    if isinstance(root_ref, str) and root_ref.startswith(_DEFS):
        root = root_ref.removeprefix(_DEFS)
        top = {**defs[root], **top}
        stack: tuple[str, ...] = (root,)
    else:
        stack = ()
    inlined: dict[str, Any] = resolve(top, stack)
    kept: dict[str, Any] = {}
    while pending := sorted(recursive - kept.keys()):
        for target in pending:
            kept[target] = resolve(defs[target], (target,))
    inlined.pop("title", None)
    if kept:
        inlined["$defs"] = kept
    return inlined


def docstring_summary(fn: Callable[..., Any]) -> str:
    """The first paragraph of ``fn``'s docstring on one line ("" when it has none)."""
    doc = inspect.getdoc(fn) or ""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines() if line.strip())


def check_explicit(parameters: Any, name: str) -> dict[str, Any]:
    """An explicit schema, checked: a JSON-encodable object schema."""
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolRegistrationError(
            f"tool {name!r}: parameters must be a JSON schema dict with type 'object',"
            f" got {type(parameters).__name__}",
            field="parameters",
            tool=name,
        )
    try:
        return msgspec.json.decode(msgspec.json.encode(parameters))  # type: ignore[no-any-return]
    except (TypeError, ValueError) as exc:
        raise ToolRegistrationError(
            f"tool {name!r}: parameters is not plain JSON ({exc})", field="parameters", tool=name
        ) from exc
