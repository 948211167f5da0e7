"""GET /v1/responses/{id}/input_items: the items a stored response was made from, as OpenAI lists them.

A response keeps its request's own `input` (not the history that `previous_response_id` brought,
nor the instructions) as items with ids: a string input is one user message, a message's string
content one `input_text` part, and an item sent back from an earlier output keeps its id. The
list is a cursor page: `limit` (1 to 100, 20 by default), `order` (desc by default), and the
cursors `after` and `before`, item ids of this list; an id not in it is a 400 naming the cursor.
"""
from __future__ import annotations

import uuid

import msgspec
from multidict import MultiMapping

from gateway import responses_protocol as rp
from gateway.errors import invalid

MAX_LIMIT = 100
DEFAULT_LIMIT = 20
_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _content(content: str | list[rp.InputPart], role: str) -> list[dict]:
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        content = [rp.InputPart(type=kind, text=content)]
    parts = []
    for p in content:
        part = {"type": p.type, "text": p.text}
        if p.type == "output_text":
            part["annotations"] = p.annotations or []
            part["logprobs"] = p.logprobs or []
        parts.append(part)
    return parts


def items_of(req: rp.ResponsesRequest) -> list[dict]:
    """The request's input as the items the list returns, in the order sent (after rp.validate
    and rp.input_messages have accepted it, so each item has what its type needs)."""
    if isinstance(req.input, str):
        return [{"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "user", "status": "completed",
                 "content": _content(req.input, "user")}]
    items = []
    for item in req.input:
        out: dict = {"id": item.id or f"{_PREFIX[item.type]}_{uuid.uuid4().hex}", "type": item.type}
        if item.type == "message":
            out |= {"role": item.role, "status": item.status or "completed",
                    "content": _content(item.content, item.role)}
        elif item.type == "function_call":
            out |= {"call_id": item.call_id, "name": item.name, "arguments": item.arguments,
                    "status": item.status or "completed"}
        else:
            output = item.output if isinstance(item.output, str) else msgspec.to_builtins(item.output)
            out |= {"call_id": item.call_id, "output": output, "status": item.status or "completed"}
        items.append(out)
    return items


def page(items: list[dict], query: MultiMapping[str]) -> dict:
    """One page of `items` (in the order sent) as the query asks for it."""
    known = {"limit", "order", "after", "before", "include", "include[]"}
    for name in query:
        if name not in known:
            raise invalid(f"Unknown query parameter `{name}`; the list takes {', '.join(sorted(known - {'include[]'}))}.",
                          param=name)
    include = query.getall("include", []) + query.getall("include[]", [])
    if include:
        raise invalid(f"`include` {include[0]!r} adds nothing to input items here: they are returned whole.",
                      param="include")
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise invalid("`limit` must be an integer.", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid(f"`limit` must be in [1, {MAX_LIMIT}], got {limit}.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"`order` must be asc or desc, got {order!r}.", param="order")
    ordered = items if order == "asc" else items[::-1]
    ids = [i["id"] for i in ordered]
    start, end = 0, len(ordered)
    for cursor in ("after", "before"):
        at = query.get(cursor)
        if at is None:
            continue
        if at not in ids:
            raise invalid(f"`{cursor}` {at!r} is not an input item of this response.", param=cursor)
        if cursor == "after":
            start = ids.index(at) + 1
        else:
            end = ids.index(at)
    window = ordered[start:end]
    if "before" in query and "after" not in query:   # the page just before the cursor
        data = window[-limit:]
    else:
        data = window[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(window) > limit}
