-- idem: the requests table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is a request of a completable endpoint (`#[idempotent(.., completable = true)]`)
-- that recorded a step and has not committed: what it takes to run it again, written
-- with its first step, and the completer's progress on it. The request's COMMIT deletes
-- it; the sweeper removes rows whose key has expired.
CREATE TABLE IF NOT EXISTS "idempotency_requests" (
    scope        text        NOT NULL,
    principal    text        NOT NULL,
    key          text        NOT NULL,
    -- SHA-256 of the request's canonical fingerprint, as its steps have it
    fingerprint  bytea       NOT NULL,
    -- the request as it arrived: method, path and query, the allowed headers (a JSON
    -- array of [name, value]) and the body; NULL for a request an operator abandoned
    -- whose endpoint stores none
    method       text,
    target       text,
    headers      text,
    body         bytea,
    -- 'pending' (to complete), 'abandoning' (an operator gave it up: compensate),
    -- 'failed' (parked after too many definitive failures)
    state        text        NOT NULL DEFAULT 'pending',
    -- every run of the completer, and the definitive failures among them
    tries        integer     NOT NULL DEFAULT 0,
    failures     integer     NOT NULL DEFAULT 0,
    next_at      timestamptz NOT NULL DEFAULT now(),
    leased_until timestamptz,
    last_error   text,
    error_at     timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    CONSTRAINT "idempotency_requests_pkey" PRIMARY KEY (scope, principal, key)
);

-- The sweeper deletes expired rows.
CREATE INDEX IF NOT EXISTS "idempotency_requests_expires_at_idx" ON "idempotency_requests" (expires_at);

-- The request's per-field hashes (`Fingerprint::parts`, as the keys' rows keep them),
-- added after the table's first migration: after a deploy that reorders or adds `fields`,
-- a retry is compared on the fields both versions share.
ALTER TABLE "idempotency_requests" ADD COLUMN IF NOT EXISTS field_hashes bytea;
