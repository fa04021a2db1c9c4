"""Admin API tokens (outbox/tokens.py): stored as hashes, scoped to a tenant or not."""

from __future__ import annotations

from sqlalchemy import text

# Create a token (its secret is stored only as a hash).
INSERT_TOKEN = text(
    """
    INSERT INTO admin_tokens (token_id, name, role, secret_hash, created_by, tenant_uid,
                              expires_at)
    VALUES (:token_id, :name, :role, :secret_hash, :created_by, :tenant_uid, :expires_at)
    RETURNING id, token_id, name, role, created_by, created_at, last_used_at, revoked_at,
              tenant_uid AS tenant, expires_at
    """
)

# The tokens in scope, revoked ones on request.
SELECT_TOKENS = text(
    """
    SELECT id, token_id, name, role, created_by, created_at, last_used_at, revoked_at,
           tenant_uid AS tenant, expires_at
    FROM admin_tokens
    WHERE (CAST(:include_revoked AS boolean) OR revoked_at IS NULL)
      AND (CAST(:scope AS text) IS NULL OR tenant_uid = :scope)
    ORDER BY id
    """
)

# The token a request presents, for authentication.
# Revoked rows too, so a token revoked because its tenant was deleted can say so.
SELECT_TOKEN_FOR_AUTH = text(
    """
    SELECT k.id, k.name, k.role, k.secret_hash, k.revoked_at, k.tenant_uid, k.expires_at,
           (k.tenant_uid IS NULL OR EXISTS (SELECT 1 FROM tenants t WHERE t.uid = k.tenant_uid))
               AS tenant_exists
    FROM admin_tokens k
    WHERE k.token_id = :token_id
    """
)

# Record a token's last use.
TOUCH_TOKEN = text("UPDATE admin_tokens SET last_used_at = :now WHERE id = :id")

# The live tokens a revoke names (by name or token id), in scope.
SELECT_TOKENS_TO_REVOKE = text(
    """
    SELECT id, token_id, tenant_uid FROM admin_tokens
    WHERE (name = :name OR token_id = :name) AND revoked_at IS NULL
      AND (CAST(:scope AS text) IS NULL OR tenant_uid = :scope)
    ORDER BY id
    """
)

# Revoke one token, once.
REVOKE_TOKEN = text(
    """
    UPDATE admin_tokens SET revoked_at = :now
    WHERE id = :id AND revoked_at IS NULL
    RETURNING token_id, tenant_uid
    """
)
