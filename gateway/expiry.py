"""When the Batch API's files and batches go: OpenAI's `expires_after` policies on files (and
`output_expires_after` on a batch's output and error files), and the retention of ended batches.

A policy is {"anchor": "created_at", "seconds": N} with N from an hour to 30 days, OpenAI's
bounds; without one a file keeps --batch-file-ttl. An ended batch, with its output and error files,
is deleted --batch-retention after it ended.
"""
from __future__ import annotations

import msgspec

from gateway.errors import invalid

MIN_S, MAX_S = 3600, 30 * 86400
ENDED_AT = ("completed_at", "failed_at", "expired_at", "cancelled_at")


class ExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    seconds: int
    anchor: str = "created_at"


def seconds_of(policy: ExpiresAfter | None, param: str) -> int | None:
    """A policy's seconds, checked; None without one (the configured default applies)."""
    if policy is None:
        return None
    if policy.anchor != "created_at":
        raise invalid(f"`{param}.anchor` must be 'created_at', got {policy.anchor!r}.", param=param)
    if not MIN_S <= policy.seconds <= MAX_S:
        raise invalid(f"`{param}.seconds` must be from {MIN_S} (an hour) to {MAX_S} (30 days), got "
                      f"{policy.seconds}.", param=param)
    return policy.seconds


def from_form(fields: dict[str, str], param: str = "expires_after") -> int | None:
    """The policy of a multipart upload, sent as `expires_after[anchor]` and `expires_after[seconds]`."""
    anchor, seconds = fields.get(f"{param}[anchor]"), fields.get(f"{param}[seconds]")
    if anchor is None and seconds is None:
        return None
    try:
        value = int(seconds) if seconds is not None else None
    except ValueError:
        value = None
    if value is None:
        raise invalid(f"`{param}[seconds]` must be an integer number of seconds.", param=param)
    return seconds_of(ExpiresAfter(seconds=value, anchor=anchor or "created_at"), param)


def ended_at(batch: dict) -> int | None:
    """When the batch ended; None while it runs."""
    return next((batch[k] for k in ENDED_AT if batch.get(k)), None)


def past_retention(batch: dict, retention_s: float, now: int) -> bool:
    end = ended_at(batch)
    return end is not None and end + retention_s <= now
