"""The tables, declared once with SQLAlchemy Core.

Migrations in migrations/ create exactly this (a test compares them). The state
machine of a delivery is enforced here as far as a schema can:

    scheduled -> in_flight -> succeeded
                           -> scheduled   (retryable failure, attempts left)
                           -> dead        (permanent failure or attempts used up)
    scheduled | dead -> discarded         (operator, with a reason)
    dead -> replay inserts a NEW delivery (replay_of = old id); the old row never changes
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, BYTEA, JSONB

from outbox.schema_access import admin_tokens as admin_tokens
from outbox.schema_access import audit_log as audit_log
from outbox.schema_access import console_sessions as console_sessions
from outbox.schema_access import portal_links as portal_links
from outbox.schema_base import (
    ATTEMPT_OUTCOMES as ATTEMPT_OUTCOMES,
)
from outbox.schema_base import (
    DELIVERY_STATES as DELIVERY_STATES,
)
from outbox.schema_base import (
    NAMING as NAMING,
)
from outbox.schema_base import (
    ON_AMBIGUOUS as ON_AMBIGUOUS,
)
from outbox.schema_base import (
    OWNER_FORMAT as OWNER_FORMAT,
)
from outbox.schema_base import (
    TERMINAL_STATES as TERMINAL_STATES,
)
from outbox.schema_base import (
    _now_column as _now_column,
)
from outbox.schema_base import (
    metadata as metadata,
)
from outbox.schema_catalogue import EVENT_TYPE_STATUSES as EVENT_TYPE_STATUSES
from outbox.schema_catalogue import event_type_versions as event_type_versions
from outbox.schema_catalogue import event_types as event_types

# The owners of endpoints: the application's customers. `uid` is the application's own
# customer id. Every endpoint belongs to one tenant; an event is published for one tenant
# and reaches that tenant's matching endpoints only (plus endpoints marked all_tenants).
# Installations from before tenants run under the default tenant (migration 0006).
DEFAULT_TENANT = "default"

tenants = Table(
    "tenants",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("uid", Text, nullable=False, unique=True),
    Column("name", Text, nullable=False, server_default=text("''")),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("disabled_reason", Text),
    Column("disabled_at", DateTime(timezone=True)),
    # Optional caps across all of the tenant's endpoints (NULL: unlimited).
    Column("max_in_flight", Integer),
    Column("max_per_second", Float),
    _now_column("created_at"),
    _now_column("updated_at"),
    CheckConstraint("uid ~ '^[^[:cntrl:]]{1,255}$'", name="uid_format"),
    CheckConstraint("enabled OR disabled_reason IS NOT NULL", name="disabled_has_reason"),
    CheckConstraint(
        "(max_in_flight IS NULL OR max_in_flight > 0)"
        " AND (max_per_second IS NULL OR max_per_second > 0)",
        name="positive_limits",
    ),
)


def _tenant_column() -> Column[int]:
    return Column(
        "tenant_id",
        BigInteger,
        ForeignKey("tenants.id", ondelete="CASCADE"),
        nullable=False,
    )


outbox_events = Table(
    "outbox_events",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("message_id", Text, nullable=False, unique=True),
    _tenant_column(),
    Column("event_type", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("idempotency_key", Text),
    Column("ordering_key", Text),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    _now_column("created_at"),
    Column("relayed_at", DateTime(timezone=True)),
    # Published through the SQL function outbox_publish() (migration 0009): the relay checks
    # the payload against the event type's schema before fanning it out.
    Column("validate_pending", Boolean, nullable=False, server_default=text("false")),
    # Set by the relay when the payload broke its schema (or its type was unknown in strict
    # mode): the event is not sent; `outbox events requeue` puts it back.
    Column("rejected_at", DateTime(timezone=True)),
    Column("rejected_reason", Text),
    # W3C trace context of publish() when the application traces (migration 0014).
    Column("traceparent", Text),
    # The document the event is about ("invoice/inv_7"), from publish(subject=...): the
    # application's status_by_subject(), the deliveries filter, replay's staleness check.
    Column("subject", Text),
    # sha256 of the payload's canonical text (jsonb's rendering), for events with an
    # idempotency key: the same key with another payload is refused (migration 0028).
    # NULL on older rows: compared by hashing their payload on the fly.
    Column("payload_hash", BYTEA),
    # Idempotency keys are unique per tenant (migration 0006).
    Index(
        "uq_outbox_events_tenant_id_idempotency_key",
        "tenant_id",
        "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
    ),
    # Keeps "what is left to relay" cheap however large the relayed history grows.
    Index("ix_outbox_events_unrelayed", "id", postgresql_where=text("relayed_at IS NULL")),
    # Per-key ordering: "is an earlier event of this key still waiting for the relay?"
    Index(
        "ix_outbox_events_unrelayed_keys",
        "ordering_key",
        "id",
        postgresql_where=text("relayed_at IS NULL AND ordering_key IS NOT NULL"),
    ),
    # Retention prunes relayed events oldest first (migration 0005).
    Index(
        "ix_outbox_events_relayed_at",
        "relayed_at",
        postgresql_where=text("relayed_at IS NOT NULL"),
    ),
    # What the relay must validate first, and the rejected events operators look at (0009).
    Index(
        "ix_outbox_events_validate_pending",
        "id",
        postgresql_where=text("relayed_at IS NULL AND validate_pending"),
    ),
    Index("ix_outbox_events_rejected", "id", postgresql_where=text("rejected_at IS NOT NULL")),
    # A tenant's events about one document, newest first (migration 0029, built online).
    Index(
        "ix_outbox_events_tenant_id_subject",
        "tenant_id",
        "subject",
        "id",
        postgresql_where=text("subject IS NOT NULL"),
    ),
)

endpoints = Table(
    "endpoints",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("uid", Text, nullable=False, unique=True),
    _tenant_column(),
    # Receives the events of every tenant (an internal data warehouse, say), not only
    # its own tenant's. Set at creation, explicitly.
    Column("all_tenants", Boolean, nullable=False, server_default=text("false")),
    Column("url", Text, nullable=False),
    Column("description", Text, nullable=False, server_default=text("''")),
    Column("event_types", ARRAY(Text), nullable=False),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("disabled_reason", Text),
    Column("disabled_at", DateTime(timezone=True)),
    # Encrypted (outbox.crypto); never plaintext.
    Column("signing_secret", Text, nullable=False),
    # 'hmac' (v1, whsec_ secrets) or 'ed25519' (v1a, whsk_ secret keys); migration 0009.
    # The scheme of the current secret: during a rotation the previous one may differ.
    Column("signature_scheme", Text, nullable=False, server_default=text("'hmac'")),
    # The `whpk_` public key of an ed25519 secret key: public, so stored in the clear.
    Column("signing_public_key", Text),
    Column("previous_signing_secret", Text),
    Column("previous_secret_expires_at", DateTime(timezone=True)),
    # Custom request headers (say, an Authorization a partner asked for): JSON of
    # {name: value}, encrypted like the secrets, because they are often credentials.
    Column("custom_headers", Text),
    # The endpoint's own egress proxy (migration 0023): its URL encrypted like the secrets
    # (it may carry credentials), and only `host:port` in the clear, for display.
    Column("proxy_url", Text),
    Column("proxy_host", Text),
    # How it gets its events (migration 0025): 'push' (HTTP POSTs), 'pull' (only its
    # catch-up feed, outbox/feeds.py) or 'both'.
    Column("delivery_mode", Text, nullable=False, server_default=text("'push'")),
    # A SQL/JSON path predicate on the payload (outbox/filters.py); NULL: every event.
    Column("payload_filter", Text),
    # SHA-256 of the feed token (shown once when created or rotated).
    Column("feed_token_hash", Text),
    # Authenticated delivery (migration 0037): a client certificate and key (mutual TLS)
    # and OAuth2 client credentials, encrypted like the secrets, each with a JSON summary
    # in the clear for display (subject, fingerprint, expiry; token URL, client id, scope).
    Column("client_certificate", Text),
    Column("client_certificate_info", Text),
    Column("oauth_client", Text),
    Column("oauth_client_info", Text),
    Column("timeout_seconds", Float),
    Column("max_attempts", Integer),
    Column("retry_schedule", ARRAY(Float)),
    # {"404": "retryable"}: per-status outcomes that replace the default table.
    Column("status_overrides", JSONB),
    # Hold ambiguous outcomes for a person ('hold') or retry them (NULL, 'retry'); the
    # team that owns this endpoint's failures; and, for an endpoint that receives
    # operational events, the one owner whose events it takes (migration 0031).
    Column("on_ambiguous", Text),
    Column("owner", Text),
    Column("operational_owner", Text),
    _now_column("created_at"),
    _now_column("updated_at"),
    CheckConstraint("cardinality(event_types) > 0", name="has_event_types"),
    CheckConstraint("on_ambiguous IN ('retry', 'hold')", name="known_on_ambiguous"),
    CheckConstraint(f"owner ~ '{OWNER_FORMAT}'", name="owner_format"),
    CheckConstraint(f"operational_owner ~ '{OWNER_FORMAT}'", name="operational_owner_format"),
    CheckConstraint("signature_scheme IN ('hmac', 'ed25519')", name="known_signature_scheme"),
    Index("ix_endpoints_tenant_id", "tenant_id"),
    CheckConstraint("enabled OR disabled_reason IS NOT NULL", name="disabled_has_reason"),
    CheckConstraint("delivery_mode IN ('push', 'pull', 'both')", name="known_delivery_mode"),
)

DELIVERY_MODES = ("push", "pull", "both")

# An endpoint's feed (migration 0025): the last position handed out and the position
# retention pruned through. The relay takes this row's lock when it appends, so one
# endpoint's positions are in commit order: a reader never skips a position that
# commits later. Kept apart from `endpoints` so appends never block endpoint edits.
endpoint_feeds = Table(
    "endpoint_feeds",
    metadata,
    Column(
        "endpoint_id",
        BigInteger,
        ForeignKey("endpoints.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("last_position", BigInteger, nullable=False, server_default=text("0")),
    Column("pruned_through", BigInteger, nullable=False, server_default=text("0")),
)

# The feed itself: one row per event for a pull or push+pull endpoint, read by a
# primary-key range scan (endpoint_id, position > cursor).
feed_entries = Table(
    "feed_entries",
    metadata,
    Column(
        "endpoint_id",
        BigInteger,
        ForeignKey("endpoints.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("position", BigInteger, primary_key=True),
    Column(
        "event_id",
        BigInteger,
        ForeignKey("outbox_events.id", ondelete="CASCADE"),
        nullable=False,
    ),
    _now_column("created_at"),
    Index("ix_feed_entries_event_id", "event_id"),
    Index("ix_feed_entries_created_at", "created_at"),
)

# Events an endpoint's payload filter could not evaluate (say, `$.amount >= 100` on a
# string amount): skipped for that endpoint, counted and kept here until retention.
filter_skips = Table(
    "filter_skips",
    metadata,
    Column(
        "endpoint_id",
        BigInteger,
        ForeignKey("endpoints.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("event_id", BigInteger, primary_key=True),
    _now_column("created_at"),
    Index("ix_filter_skips_created_at", "created_at"),
)

deliveries = Table(
    "deliveries",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column(
        "event_id",
        BigInteger,
        ForeignKey("outbox_events.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column(
        "endpoint_id",
        BigInteger,
        ForeignKey("endpoints.id", ondelete="CASCADE"),
        nullable=False,
    ),
    # The endpoint's tenant (copied at fan-out; an endpoint never changes tenant): scoping
    # and per-tenant fairness read it without a join. For an all_tenants endpoint this is
    # the endpoint's owner, not the event's tenant: the event's tenant never sees it.
    _tenant_column(),
    Column("state", Text, nullable=False, server_default=text("'scheduled'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    # Times the reaper took it back from a worker that died mid-attempt (not attempts).
    Column("rescues", Integer, nullable=False, server_default=text("0")),
    # The fencing token: every claim bumps it and every write back (outcome, release,
    # rescue) must match the value its claim returned, so a worker that lost its claim
    # can only add history. Also the attempt number: one attempt per claim at most.
    Column("claims", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False),
    Column("next_attempt_at", DateTime(timezone=True), nullable=False),
    Column("locked_by", Text),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("last_status_code", Integer),
    Column("last_error", Text),
    Column("final_reason", Text),
    Column("replay_of", BigInteger, ForeignKey("deliveries.id", ondelete="SET NULL")),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    Column("ordering_key", Text),
    _now_column("created_at"),
    _now_column("updated_at"),
    Column("completed_at", DateTime(timezone=True)),
    # 'held' (migration 0031-0033): an ambiguous outcome waiting for a person.
    CheckConstraint(
        "state IN ('scheduled', 'in_flight', 'succeeded', 'dead', 'discarded', 'held')",
        name="known_state_held",
    ),
    CheckConstraint(
        "state <> 'in_flight' OR (locked_by IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="in_flight_is_leased",
    ),
    CheckConstraint("attempts >= 0 AND max_attempts > 0", name="attempt_counts"),
    # One first delivery per (event, endpoint): a relay can never fan out twice.
    Index(
        "uq_deliveries_first_per_endpoint",
        "event_id",
        "endpoint_id",
        unique=True,
        postgresql_where=text("replay_of IS NULL"),
    ),
    # "What is due now", in the claim's order (priority, due time, id: migration 0020
    # built it online): only scheduled rows are indexed. A claim among many tenants walks
    # it from the front (delivery/queries.py, RANK_CLAIM_GATES).
    Index(
        "ix_deliveries_due_ranked",
        text("priority DESC"),
        "next_attempt_at",
        "id",
        postgresql_where=text("state = 'scheduled'"),
    ),
    # Leases to rescue when a worker dies.
    Index("ix_deliveries_leases", "lease_expires_at", postgresql_where=text("state = 'in_flight'")),
    Index("ix_deliveries_endpoint_state", "endpoint_id", "state"),
    Index("ix_deliveries_replay_of", "replay_of", postgresql_where=text("replay_of IS NOT NULL")),
    # At most one pending replay per original (migration 0008): two operators replaying
    # the same delivery at once, from the CLI and the API, cannot send it twice.
    Index(
        "uq_deliveries_one_pending_replay",
        "replay_of",
        unique=True,
        postgresql_where=text("replay_of IS NOT NULL AND state IN ('scheduled', 'in_flight')"),
    ),
    # A tenant's deliveries, newest first (scoped lists and stats).
    Index("ix_deliveries_tenant_id_id", "tenant_id", "id"),
    # Fair claiming walks each endpoint's due rows in claim order (delivery/health/);
    # `id` last (migration 0020): an endpoint's head is one row, whatever the storage order.
    Index(
        "ix_deliveries_due_per_endpoint_ranked",
        "endpoint_id",
        text("priority DESC"),
        "next_attempt_at",
        "id",
        postgresql_where=text("state = 'scheduled'"),
    ),
    # "Is this the head of its key?" for endpoints with per-key ordering.
    Index(
        "ix_deliveries_ordering",
        "endpoint_id",
        "ordering_key",
        "event_id",
        postgresql_where=text("ordering_key IS NOT NULL"),
    ),
    # What a tenant has in flight, for per-tenant caps (migration 0010): in-flight rows
    # are few, so this stays small however long the tenant's history is.
    Index(
        "ix_deliveries_tenant_id_in_flight",
        "tenant_id",
        postgresql_where=text("state = 'in_flight'"),
    ),
    # All deliveries of one event (first and replays): retention's group checks and
    # the ON DELETE CASCADE from outbox_events need it (migration 0005).
    Index("ix_deliveries_event_id_endpoint_id", "event_id", "endpoint_id"),
    # Retention walks finished deliveries oldest first (migration 0005).
    Index(
        "ix_deliveries_completed_at",
        "completed_at",
        postgresql_where=text("state IN ('succeeded', 'dead', 'discarded')"),
    ),
    # Held deliveries, per tenant (migration 0033): lists and counts of what needs review.
    Index("ix_deliveries_held", "tenant_id", "id", postgresql_where=text("state = 'held'")),
)

delivery_attempts = Table(
    "delivery_attempts",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column(
        "delivery_id",
        BigInteger,
        ForeignKey("deliveries.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("attempt_number", Integer, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("duration_ms", Integer, nullable=False),
    Column("status_code", Integer),
    Column("outcome", Text, nullable=False),
    Column("error", Text),
    Column("response_excerpt", Text),
    Column("request_headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("worker_id", Text, nullable=False),
    CheckConstraint(
        "outcome IN ('succeeded', 'retryable', 'permanent', 'ambiguous')", name="known_outcome"
    ),
    # Attempt numbers are claim numbers (deliveries.claims), unique per delivery: a late
    # outcome from a lost claim keeps its own number (migration 0007).
    Index(
        "uq_delivery_attempts_delivery_id_attempt_number",
        "delivery_id",
        "attempt_number",
        unique=True,
    ),
    # Stats and metrics read the attempts of a recent window (migration 0005).
    Index("ix_delivery_attempts_started_at", "started_at"),
)

# What retention (and endpoint or tenant deletion) removed, by tenant and metric name,
# so the totals exported on /metrics, whole or scoped to a tenant, never go backwards
# when history is pruned (migrations 0003, 0018). No foreign key: a deleted tenant's
# tallies still count in the whole; tenant_id 0 holds tallies older than 0018.
pruned_totals = Table(
    "pruned_totals",
    metadata,
    Column("tenant_id", BigInteger, primary_key=True, server_default=text("0")),
    Column("name", Text, primary_key=True),
    Column("value", Float, nullable=False, server_default=text("0")),
)

# Bucket bounds (seconds) of the attempt latency histogram. Pruned attempts are tallied
# into pruned_totals under these bounds ('attempt_seconds_le:<bound>'), so /metrics and
# every tally (retention, endpoint and tenant deletion) must use the same ones: changed,
# the exported histogram would go backwards.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


BREAKER_STATES = ("closed", "open", "half_open")
DEAD_HEAD_MODES = ("block", "skip")

# Per-endpoint limits, ordering and circuit-breaker state, shared by every worker
# process. A missing row means: no limits, no ordering, breaker closed. Kept apart
# from `endpoints` because workers write it on every outcome batch, and row locks
# on it (claims take them with SKIP LOCKED) must not block endpoint edits.
endpoint_health = Table(
    "endpoint_health",
    metadata,
    Column(
        "endpoint_id",
        BigInteger,
        ForeignKey("endpoints.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    # Configuration (NULL: unlimited).
    Column("max_in_flight", Integer),
    Column("max_per_second", Float),
    Column("ordered", Boolean, nullable=False, server_default=text("false")),
    Column("dead_head", Text, nullable=False, server_default=text("'block'")),
    # Circuit breaker.
    Column("breaker_state", Text, nullable=False, server_default=text("'closed'")),
    Column("consecutive_failures", Integer, nullable=False, server_default=text("0")),
    Column("window_started_at", DateTime(timezone=True)),
    Column("window_attempts", Integer, nullable=False, server_default=text("0")),
    Column("window_failures", Integer, nullable=False, server_default=text("0")),
    Column("trips", Integer, nullable=False, server_default=text("0")),
    Column("opened_at", DateTime(timezone=True)),
    Column("open_until", DateTime(timezone=True)),
    Column("probe_until", DateTime(timezone=True)),
    Column("ramp_started_at", DateTime(timezone=True)),
    Column("ramp_until", DateTime(timezone=True)),
    Column("paused_until", DateTime(timezone=True)),
    # Token bucket for max_per_second and the ramp (NULL: full).
    Column("tokens", Float),
    Column("tokens_at", DateTime(timezone=True)),
    # Auto-disable: start of the current unbroken run of failures.
    Column("failing_since", DateTime(timezone=True)),
    Column("last_failure", Text),
    # Adaptive concurrency (migration 0039; delivery/health/adaptive.py): opted in, the
    # current in-flight limit, the unloaded latency it compares with, its window's start.
    Column("adaptive", Boolean, nullable=False, server_default=text("false")),
    Column("adaptive_limit", BigInteger),
    Column("latency_baseline_ms", Float),
    Column("adaptive_window_at", DateTime(timezone=True)),
    # The gradient limiter's unrounded limit (migration 0046).
    Column("adaptive_estimate", Float),
    _now_column("updated_at"),
    CheckConstraint("breaker_state IN ('closed', 'open', 'half_open')", name="known_breaker_state"),
    CheckConstraint("dead_head IN ('block', 'skip')", name="known_dead_head"),
    CheckConstraint(
        "(max_in_flight IS NULL OR max_in_flight > 0)"
        " AND (max_per_second IS NULL OR max_per_second > 0)",
        name="positive_limits",
    ),
)

# Default priority of an event type, applied when publish() is not given one.
event_type_priorities = Table(
    "event_type_priorities",
    metadata,
    Column("event_type", Text, primary_key=True),
    Column("priority", SmallInteger, nullable=False),
    _now_column("updated_at"),
    CheckConstraint("priority BETWEEN -100 AND 100", name="priority_range"),
)

# The routing index (migration 0010): one row per (endpoint, pattern), with the endpoint's
# tenant, or NULL for an all_tenants endpoint. The relay looks up, per event, only the
# patterns that can match it ('*', the exact type, each 'prefix.*'), so routing costs
# follow the matching endpoints, not the number of endpoints. A trigger on `endpoints`
# keeps it in step (insert, change of patterns or tenant, delete through the cascade):
# every writer of endpoints, including SQL run by hand or by the bench, is covered.
endpoint_subscriptions = Table(
    "endpoint_subscriptions",
    metadata,
    Column(
        "endpoint_id",
        BigInteger,
        ForeignKey("endpoints.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("pattern", Text, primary_key=True),
    Column("tenant_id", BigInteger),
    Index("ix_endpoint_subscriptions_pattern_tenant_id", "pattern", "tenant_id"),
)

# Token bucket of tenants with a max_per_second cap (migration 0010). Kept apart from
# `tenants` so claims write it without touching the rows operators edit; a missing row
# means a full bucket. Claims serialise on the tenant row (FOR NO KEY UPDATE SKIP LOCKED).
tenant_buckets = Table(
    "tenant_buckets",
    metadata,
    Column(
        "tenant_id",
        BigInteger,
        ForeignKey("tenants.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("tokens", Float, nullable=False),
    Column("tokens_at", DateTime(timezone=True), nullable=False),
)

# Storm bounds of operational events (migration 0009): per endpoint and kind, when one
# was last sent and how many were held back in the current window.
operational_event_marks = Table(
    "operational_event_marks",
    metadata,
    Column(
        "endpoint_id",
        BigInteger,
        ForeignKey("endpoints.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("kind", Text, primary_key=True),
    Column("window_start", DateTime(timezone=True), nullable=False),
    Column("emitted", Integer, nullable=False, server_default=text("0")),
    Column("suppressed", Integer, nullable=False, server_default=text("0")),
    # The held-back deaths of the window per owner ('' for none; migration 0041): one
    # delivery.dead summary per owner, naming it.
    Column("suppressed_owners", JSONB, nullable=True),
    Index(
        "ix_operational_event_marks_suppressed",
        "window_start",
        postgresql_where=text("suppressed > 0"),
    ),
)
