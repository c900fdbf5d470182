-- idem: the audit table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is one action an operator took on idem's tables (a purge, a sweep, a re-drive,
-- a discard), from the console, the command line or the service's own code. It is
-- written in the transaction of the action itself, so a row says what was done and an
-- action rolled back leaves none; a sweep, which commits batch by batch, writes its row
-- after its last batch. idem never updates or deletes a row.
CREATE TABLE IF NOT EXISTS "idem_audit" (
    id       bigserial   NOT NULL,
    at       timestamptz NOT NULL DEFAULT now(),
    -- who: the console's operator header, the command line's --operator
    operator text        NOT NULL,
    -- through what: console, cli, or what the service names
    via      text        NOT NULL,
    -- purge, sweep, redrive, redrive_forced or discard
    action   text        NOT NULL,
    -- what the action selected: a key with its scope and principal, event ids, a
    -- reason, all, a batch size
    filter   text        NOT NULL,
    -- how many rows it moved
    rows     bigint      NOT NULL,
    CONSTRAINT "idem_audit_pkey" PRIMARY KEY (id)
);
