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

-- One row per processed webhook event and provider (payments, stripe, github).
CREATE TABLE IF NOT EXISTS webhook_events (
    provider     text        NOT NULL,
    id           text        NOT NULL,
    type         text        NOT NULL,
    payload      jsonb       NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, id)
);
-- A table made before there were several providers held the payment provider's events.
ALTER TABLE webhook_events ADD COLUMN IF NOT EXISTS provider text NOT NULL DEFAULT 'payments';

-- Set by `charge.refunded` events from the payment provider.
ALTER TABLE charges ADD COLUMN IF NOT EXISTS refunded_by_provider boolean NOT NULL DEFAULT false;

-- The ledger the queue consumer (src/consumer.rs) credits, once per message.
CREATE TABLE IF NOT EXISTS ledger_entries (
    message_id text        PRIMARY KEY,
    account    text        NOT NULL,
    amount     bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Distributed PostgreSQL (Citus): after creating the tables, distribute them by account,
-- colocated, so that a request's claim, charge and refunds are one single-node
-- transaction. idem's table is distributed by its principal column (the account here, of
-- the same type, `text`), with the store built `.portable()` (Store::schema_sql then ends
-- with the same advice):
--
--   SELECT create_distributed_table('charges', 'account');
--   SELECT create_distributed_table('refunds', 'account', colocate_with => 'charges');
--   SELECT create_distributed_table('idempotency_keys', 'principal', colocate_with => 'charges');
--   ALTER DATABASE your_database SET citus.propagate_set_commands = 'local';
--
-- webhook_events and ledger_entries are not keyed by account, and the idempotency
-- records of their keys have no principal: they do not colocate with the tables above,
-- and this example leaves their distribution open.
