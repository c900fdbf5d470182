-- idem: the outbox's walk index (idem 0.1 after 2026-11-27), for users who run their own
-- migrations. `Store::migrate` runs the same; it is safe to run again.
--
-- The relay's take walks the first pending row of each ordering key, and the rows without
-- a key in order, through this index: its cost per event no longer grows with the backlog.
-- It replaces `idem_outbox_ordering_idx`, which lacked the rows without a key.
CREATE INDEX IF NOT EXISTS "idem_outbox_heads_idx" ON "idem_outbox" (ordering_key, seq)
    WHERE dead_at IS NULL;
DROP INDEX IF EXISTS "idem_outbox_ordering_idx";
