-- idem: the request's per-field hashes beside its steps and its stored copy (idem 0.1
-- after 2026-11-29), for users who run their own migrations. `Store::migrate` runs the
-- same; it is safe to run again.
--
-- A step's record was compared with a retry on the request's combined hash alone: after
-- a deploy that reordered or added `fields`, the retry of a request that had recorded a
-- step answered 422 and could never resume. Like the keys' rows, the steps and stored
-- requests now keep each field's hash, and a retry is compared on the fields both
-- versions share.
ALTER TABLE "idempotency_steps" ADD COLUMN IF NOT EXISTS field_hashes bytea;
ALTER TABLE "idempotency_requests" ADD COLUMN IF NOT EXISTS field_hashes bytea;
