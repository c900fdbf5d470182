-- idem: the outbox table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is written in a request's own transaction and commits with its business writes,
-- or not at all. The relay deletes it once the broker acknowledged it, or parks it
-- (`dead_at`) after too many attempts. Rows come and go quickly: keep autovacuum on for
-- this table and no transaction open for long on the database (an old snapshot keeps
-- every deleted row, and slows the relay's scans).
CREATE TABLE IF NOT EXISTS "idem_outbox" (
    -- the order events are written in; the relay keeps it per ordering key
    seq          bigserial   NOT NULL,
    -- stable: derived from the writing attempt's key and the event's place in it
    id           text        NOT NULL,
    topic        text        NOT NULL,
    ordering_key text,
    -- one "name: value" per line
    headers      bytea,
    payload      bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- not before: a relay's lease, or the backoff after a failed attempt
    available_at timestamptz NOT NULL DEFAULT now(),
    -- the relay holding the lease, while its session holds its advisory lock (NULL: none,
    -- or a lease that only its time ends)
    lease_owner  integer,
    -- written by each take, checked by each mark: a relay whose lease was taken over
    -- marks nothing
    lease_token  bigint,
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text,
    -- set when the relay gave up; `Store::redrive_dead_events` clears it
    dead_at      timestamptz,
    CONSTRAINT "idem_outbox_pkey" PRIMARY KEY (seq),
    CONSTRAINT "idem_outbox_id_key" UNIQUE (id)
);

-- Pending rows in order (the lag, the portable mode's relay).
CREATE INDEX IF NOT EXISTS "idem_outbox_pending_idx" ON "idem_outbox" (seq) WHERE dead_at IS NULL;
-- The relay's walk: the first pending row of each ordering key, key after key, and the
-- rows without a key (NULL, last) in order. It replaced `idem_outbox_ordering_idx`
-- (without those rows), which the relay's take read for every pending row.
CREATE INDEX IF NOT EXISTS "idem_outbox_heads_idx" ON "idem_outbox" (ordering_key, seq)
    WHERE dead_at IS NULL;
DROP INDEX IF EXISTS "idem_outbox_ordering_idx";
-- Half of each page left free: a take's lease is an update of every row it takes, and
-- rows written together share a page, so only a page half empty holds each one's new
-- version beside it (a HOT update: no new index entries). Full pages cost the drain two
-- and a half times the database's work per event (issue 36).
ALTER TABLE "idem_outbox" SET (fillfactor = 50);
-- The last ten failed publishes of each event, oldest first: when (`error_at`) and why
-- (`errors`), the same place in both. A re-drive keeps them.
ALTER TABLE "idem_outbox" ADD COLUMN IF NOT EXISTS error_at timestamptz[];
ALTER TABLE "idem_outbox" ADD COLUMN IF NOT EXISTS errors text[];
