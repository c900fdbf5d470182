-- idem: the idempotency table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is written by the claiming request's own transaction and commits together with
-- that request's business writes and its stored response, or not at all. `status` is
-- NULL only while that transaction is open, so a committed row is always complete.
CREATE TABLE IF NOT EXISTS "idempotency_keys" (
    scope        text        NOT NULL,
    principal    text        NOT NULL,
    key          text        NOT NULL,
    -- SHA-256 of the request's canonical fingerprint
    fingerprint  bytea       NOT NULL,
    -- the target hash and one hash per named field
    field_hashes bytea       NOT NULL,
    status       smallint,
    -- allow-listed response headers, one "name: value" per line
    headers      bytea,
    body         bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    CONSTRAINT "idempotency_keys_pkey" PRIMARY KEY (scope, principal, key)
);

-- The sweeper deletes expired rows oldest first, in small batches.
CREATE INDEX IF NOT EXISTS "idempotency_keys_expires_at_idx" ON "idempotency_keys" (expires_at);
