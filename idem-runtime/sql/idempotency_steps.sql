-- idem: the steps table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is the recorded result of one outside call (`Tx::step`) of a request that has
-- not committed yet, written outside that request's transaction so that a retry resumes
-- after it. The request's COMMIT deletes its rows; a request that never commits leaves
-- them until they expire with its key, and the sweeper removes them.
CREATE TABLE IF NOT EXISTS "idempotency_steps" (
    scope       text        NOT NULL,
    principal   text        NOT NULL,
    key         text        NOT NULL,
    step        text        NOT NULL,
    -- SHA-256 of the request's canonical fingerprint: a retry with another payload
    -- never sees the step
    fingerprint bytea       NOT NULL,
    -- the call's result, as JSON
    result      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    CONSTRAINT "idempotency_steps_pkey" PRIMARY KEY (scope, principal, key, step)
);

-- The sweeper deletes expired rows.
CREATE INDEX IF NOT EXISTS "idempotency_steps_expires_at_idx" ON "idempotency_steps" (expires_at);

-- The request's per-field hashes (`Fingerprint::parts`, as the keys' rows keep them),
-- added after the table's first migration: after a deploy that reorders or adds `fields`,
-- a retry is compared on the fields both versions share.
ALTER TABLE "idempotency_steps" ADD COLUMN IF NOT EXISTS field_hashes bytea;
