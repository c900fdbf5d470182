-- The charges example's own tables. idem's table is created by Idempotency::migrate.
CREATE TABLE IF NOT EXISTS charges (
    id          text        PRIMARY KEY DEFAULT 'ch_' || replace(gen_random_uuid()::text, '-', ''),
    account     text        NOT NULL,
    amount      bigint      NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL,
    customer    text        NOT NULL,
    description text,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS refunds (
    id          text        PRIMARY KEY DEFAULT 're_' || replace(gen_random_uuid()::text, '-', ''),
    charge_id   text        NOT NULL REFERENCES charges (id),
    amount      bigint      NOT NULL CHECK (amount > 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS refunds_charge_id_idx ON refunds (charge_id);

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
