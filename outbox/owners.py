"""Owners: the team a failure belongs to (an event type's or an endpoint's).

An owner is a short slug (`payments`, `team-billing.eu`): it is shown in the console, put
in operational events and used as a metrics label, so it is kept to letters, digits and
`._-`, at most 64 characters (migration 0031 checks the same in the database). The owner
of a delivery is its endpoint's owner, else its event type's: the endpoint names the
integration's team, the event type the workflow's.
"""

from __future__ import annotations

import re

from outbox.errors import OperationError
from outbox.schema import OWNER_FORMAT

_OWNER = re.compile(OWNER_FORMAT)
MAX_OWNER = 64


def check_owner(value: str) -> str:
    """The owner as given, or an error that says what an owner may be."""
    if not isinstance(value, str) or not _OWNER.fullmatch(value):
        shown = repr(value)[:80]
        raise OperationError(
            f"owner {shown} is not a team name: use 1-{MAX_OWNER} letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (e.g. payments)"
        )
    return value
