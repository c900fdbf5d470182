-- idem: the outbox's attempt history (idem 0.1 after 2026-11-28), for users who run their
-- own migrations. `Store::migrate` runs the same; it is safe to run again.
--
-- The last ten failed publishes of each event, oldest first: when (`error_at`) and why
-- (`errors`), the same place in both. `last_error` alone said only the latest, and an
-- operator deciding whether to re-drive an event asks whether it always failed the same
-- way. A re-drive keeps them.
ALTER TABLE "idem_outbox" ADD COLUMN IF NOT EXISTS error_at timestamptz[];
ALTER TABLE "idem_outbox" ADD COLUMN IF NOT EXISTS errors text[];
