-- idem: the outbox's walk index and free space (idem 0.1 after 2026-11-27), for users who run their own
-- migrations. `Store::migrate` runs the same; it is safe to run again.
--
-- The relay's take walks the first pending row of each ordering key, and the rows without
-- a key in order, through this index: its cost per event no longer grows with the backlog.
-- It replaces `idem_outbox_ordering_idx`, which lacked the rows without a key.
CREATE INDEX IF NOT EXISTS "idem_outbox_heads_idx" ON "idem_outbox" (ordering_key, seq)
    WHERE dead_at IS NULL;
DROP INDEX IF EXISTS "idem_outbox_ordering_idx";
-- Half of each page left free: a take's lease is an update of every row it takes, and
-- rows written together share a page, so only a page half empty holds each one's new
-- version beside it (a HOT update: no new index entries). Full pages cost the drain two
-- and a half times the database's work per event (issue 36).
ALTER TABLE "idem_outbox" SET (fillfactor = 50);
