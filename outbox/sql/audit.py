"""The audit log (outbox/audit.py): who did what to which row, when and why; refused API
calls are audit rows too (delivery/operator/refusals.py)."""

from __future__ import annotations

from sqlalchemy import text


# The tenant an audit row concerns, as an SQL expression.
# The tenant an audit row concerns: the one given, else the tenant of the endpoint or
# delivery it targets (so rows written anywhere, the send path included, are scoped
# without each caller looking it up). The regex guard keeps a non-numeric target id
# from reaching the bigint cast.
def _audit_tenant(target_type: str, target_id: str) -> str:
    return f"""COALESCE(CAST(:tenant_uid AS text), CASE {target_type}
        WHEN 'endpoint' THEN (SELECT atn.uid FROM endpoints ae JOIN tenants atn
                              ON atn.id = ae.tenant_id WHERE ae.uid = {target_id})
        WHEN 'delivery' THEN (SELECT atn.uid FROM deliveries ad JOIN tenants atn
                              ON atn.id = ad.tenant_id
                              WHERE ad.id = CASE WHEN {target_id} ~ '^[0-9]{{1,18}}$'
                                                 THEN CAST({target_id} AS bigint) END)
        END)"""


# Record one action, in the transaction of the action itself.
INSERT_AUDIT = text(
    f"""
    INSERT INTO audit_log
        (actor, action, target_type, target_id, reason, details, request_id, tenant_uid)
    VALUES (:actor, :action, :target_type, :target_id, :reason, CAST(:details AS jsonb),
            :request_id,
            {_audit_tenant("CAST(:target_type AS text)", "CAST(:target_id AS text)")})
    """
)

# Record many actions in one statement (bulk replay and discard).
INSERT_AUDIT_MANY = text(
    f"""
    INSERT INTO audit_log
        (actor, action, target_type, target_id, reason, details, request_id, tenant_uid)
    SELECT :actor, :action, :target_type, t.target_id, :reason, CAST(t.details AS jsonb),
           :request_id, {_audit_tenant("CAST(:target_type AS text)", "t.target_id")}
    FROM unnest(CAST(:target_ids AS text[]), CAST(:details AS text[])) AS t(target_id, details)
    """
)

# The audit log, newest first, filtered and scoped by tenant uid (keyset paging on id).
SELECT_AUDIT = text(
    """
    SELECT id, at, actor, action, target_type, target_id, reason, details, request_id,
           tenant_uid AS tenant
    FROM audit_log
    WHERE (CAST(:scope AS text) IS NULL OR tenant_uid = :scope)
      AND (CAST(:actor AS text) IS NULL OR actor = :actor)
      AND (CAST(:action AS text) IS NULL OR action = :action OR starts_with(action, :action || '.'))
      AND (CAST(:target_id AS text) IS NULL OR target_id = :target_id)
      AND (CAST(:since AS timestamptz) IS NULL OR at >= :since)
      AND (CAST(:before_id AS bigint) IS NULL OR id < :before_id)
    ORDER BY id DESC
    LIMIT :limit
    """
)

# Count one more refused API call on this interval's row, if it has one.
# Refused API calls are aggregated: one row per actor, client, status and reason per
# interval, whose details.count grows. The lookup walks ix_audit_log_at from the
# interval's start, which holds few rows precisely because they are aggregated.
BUMP_REFUSAL = text(
    """
    UPDATE audit_log
    SET details = details || jsonb_build_object(
            'count', COALESCE(CAST(details ->> 'count' AS bigint), 1) + :count,
            'last_at', CAST(:last_at AS text)),
        request_id = :request_id
    WHERE id = (
        SELECT id FROM audit_log
        WHERE at >= :since AND action = 'api.refused' AND actor = :actor AND reason = :reason
          AND details ->> 'client' IS NOT DISTINCT FROM CAST(:client AS text)
          AND details ->> 'status' = CAST(:status AS text)
          AND tenant_uid IS NOT DISTINCT FROM CAST(:tenant AS text)
        ORDER BY id LIMIT 1
    )
    RETURNING id
    """
)

# The first refused API call of its kind in an interval.
INSERT_REFUSAL = text(
    """
    INSERT INTO audit_log
        (at, actor, action, target_type, target_id, reason, details, request_id, tenant_uid)
    VALUES (:now, :actor, 'api.refused', 'http', :target_id, :reason, CAST(:details AS jsonb),
            :request_id, :tenant)
    """
)
