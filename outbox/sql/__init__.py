"""Every SQL statement of the outbox package, one module per subject.

Why a subpackage and not one queries.py: a hundred statements in one file ended up
grouped by the change that added each. By subject, the SQL a module runs sits in the
module of the same name (outbox/deliveries.py runs outbox/sql/deliveries.py), so a change
to one subject reads one short file. It is still one place per package: outbox/'s SQL is
here and nowhere else. Each statement sits under a comment whose first line says what it
is for.

- events: publishing an event, and the event types' default priorities
- relay: claiming, fanning out and handing off a batch (the claim's shared fragments too)
- deliveries: search, inspect, replay, discard, and test deliveries
- endpoints, tenants, tokens, catalogue: each subject's own rows
- audit: the audit log, refused API calls included
- stats: what `outbox stats` and /metrics count
- retention: pruning, and the tallies that keep exported totals from going backwards
- migrations: the lock that lets one `outbox migrate` run at a time
- scope: the tenant condition every operator statement carries

Hot-path statements are plain text with stable SQL so psycopg can prepare them; they are
set-based: one statement claims or fans out a whole batch. The f-strings insert constant
fragments, never input.
"""
