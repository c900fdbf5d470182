-- The charges example's own tables. idem's table is created by Store::migrate.
--
-- Keys begin with the account, the tenant idem keys requests by: a distributed engine can
-- then spread the tables by account, each account's rows and idempotency records on one
-- node (see the end of this file).
CREATE TABLE IF NOT EXISTS charges (
    account     text        NOT NULL,
    id          text        NOT NULL DEFAULT 'ch_' || replace(gen_random_uuid()::text, '-', ''),
    amount      bigint      NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL,
    customer    text        NOT NULL,
    description text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account, id)
);

CREATE TABLE IF NOT EXISTS refunds (
    account     text        NOT NULL,
    id          text        NOT NULL DEFAULT 're_' || replace(gen_random_uuid()::text, '-', ''),
    charge_id   text        NOT NULL,
    amount      bigint      NOT NULL CHECK (amount > 0),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account, id),
    FOREIGN KEY (account, charge_id) REFERENCES charges (account, id)
);

CREATE INDEX IF NOT EXISTS refunds_charge_idx ON refunds (account, charge_id);

-- One row per processed webhook event and provider (payments, stripe, github), kept
-- under the value its idempotency key is kept under (`tx.principal()`: the account the
-- event concerns, or a hash of its id), by which a distributed engine spreads it.
CREATE TABLE IF NOT EXISTS webhook_events (
    tenant       text        NOT NULL DEFAULT '',
    provider     text        NOT NULL,
    id           text        NOT NULL,
    type         text        NOT NULL,
    payload      jsonb       NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, provider, id)
);
-- A table made before there were several providers held the payment provider's events,
-- and one made before keys were spread had no tenant.
ALTER TABLE webhook_events ADD COLUMN IF NOT EXISTS provider text NOT NULL DEFAULT 'payments';
ALTER TABLE webhook_events ADD COLUMN IF NOT EXISTS tenant text NOT NULL DEFAULT '';

-- Set by `charge.refunded` events from the payment provider.
ALTER TABLE charges ADD COLUMN IF NOT EXISTS refunded_by_provider boolean NOT NULL DEFAULT false;

-- The payment processor's id of the charge (`PROCESSOR_URL`); null without a processor.
-- Nullable and without a default, so adding it rewrites nothing, and a distributed engine
-- adds it to every shard.
ALTER TABLE charges ADD COLUMN IF NOT EXISTS processor_id text;

-- The ledger the queue consumer (src/consumer.rs) credits, once per message, keyed by
-- account first like the charges.
CREATE TABLE IF NOT EXISTS ledger_entries (
    account    text        NOT NULL,
    message_id text        NOT NULL,
    amount     bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account, message_id)
);

-- Tables made before: their primary keys lead with the distribution column now.
DO $$
BEGIN
    IF (SELECT array_agg(a.attname::text ORDER BY k.n) FROM pg_constraint c,
               unnest(c.conkey) WITH ORDINALITY AS k(attnum, n), pg_attribute a
         WHERE c.conrelid = 'webhook_events'::regclass AND c.contype = 'p'
           AND a.attrelid = c.conrelid AND a.attnum = k.attnum) <> ARRAY['tenant', 'provider', 'id'] THEN
        ALTER TABLE webhook_events DROP CONSTRAINT webhook_events_pkey,
            ADD PRIMARY KEY (tenant, provider, id);
    END IF;
    IF (SELECT array_agg(a.attname::text ORDER BY k.n) FROM pg_constraint c,
               unnest(c.conkey) WITH ORDINALITY AS k(attnum, n), pg_attribute a
         WHERE c.conrelid = 'ledger_entries'::regclass AND c.contype = 'p'
           AND a.attrelid = c.conrelid AND a.attnum = k.attnum) <> ARRAY['account', 'message_id'] THEN
        ALTER TABLE ledger_entries DROP CONSTRAINT ledger_entries_pkey,
            ADD PRIMARY KEY (account, message_id);
    END IF;
END $$;

-- Distributed PostgreSQL (Citus): with DB_PORTABLE=true the service distributes these
-- tables itself at start (`charges::distribute`), each by its first key column, colocated
-- with idem's table, which is distributed by its principal: the account for charges and
-- refunds, and for webhook events and ledger credits the value their keys are kept under
-- (the account they concern, else a hash of the event id). Every request then writes one
-- shard, and commits on one worker.
