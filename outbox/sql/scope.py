"""The tenant scope of operator reads and writes, one condition shared by every subject.

Every such statement takes :scope_id, the internal id of the caller's tenant (NULL:
unscoped), from outbox.tenants.scope_params, and keeps only rows of that tenant. Enforced
here, in the queries, so a scoped caller cannot reach another tenant's row by any id (an
unknown tenant is -1: nothing). The id is resolved first, not looked up in a subquery, so
the planner sees a constant and its statistics: a small tenant's page then reads the
(tenant_id, id) index instead of walking every delivery (9 ms -> 0.1 ms on 200,000
deliveries; scope_params also keeps PostgreSQL from settling on a generic plan that
would walk them again).
"""

from __future__ import annotations


def in_scope(column: str) -> str:
    """The condition that keeps `column` (a tenant id) to the caller's tenant."""
    return f"(CAST(:scope_id AS bigint) IS NULL OR {column} = :scope_id)"
