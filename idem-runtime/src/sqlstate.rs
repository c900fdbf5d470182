//! What a database error means to idem, by its SQLSTATE: unavailable (answered 503), a
//! conflict that may simply run again. The codes idem reads are named here, once
//! (PostgreSQL's Appendix A).

/// Class 08, connection exception: the connection was lost or refused.
pub(crate) const CONNECTION_EXCEPTION_CLASS: &str = "08";
/// 22P02: a value that does not parse, as idem's guard cursor raises it on purpose.
pub(crate) const INVALID_TEXT_REPRESENTATION: &str = "22P02";
/// 23505: a unique index refused a row.
pub(crate) const UNIQUE_VIOLATION: &str = "23505";
/// 25006: a write in a read-only transaction (a standby, `default_transaction_read_only`).
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(crate) const READ_ONLY_SQL_TRANSACTION: &str = "25006";
/// 25P02: a statement after an error, in a transaction that must roll back.
pub(crate) const IN_FAILED_SQL_TRANSACTION: &str = "25P02";
/// 26000: a named statement the session does not have.
pub(crate) const INVALID_SQL_STATEMENT_NAME: &str = "26000";
/// 34000: a cursor the session does not have.
pub(crate) const INVALID_CURSOR_NAME: &str = "34000";
/// 40001: a serialization failure.
pub(crate) const SERIALIZATION_FAILURE: &str = "40001";
/// 40P01: a deadlock.
pub(crate) const DEADLOCK_DETECTED: &str = "40P01";
/// 42710: an object that exists already (a type, a constraint).
pub(crate) const DUPLICATE_OBJECT: &str = "42710";
/// 42P05: a named statement the session has already.
pub(crate) const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
/// 42P07: a table that exists already.
pub(crate) const DUPLICATE_TABLE: &str = "42P07";
/// 55006: an object in use by another session.
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(crate) const OBJECT_IN_USE: &str = "55006";
/// 55P03: a lock `NOWAIT` could not take.
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";
/// 57P01, 57P02, 57P03: the server is shutting down, crashed, or not accepting
/// connections yet.
pub(crate) const SHUTTING_DOWN: [&str; 3] = ["57P01", "57P02", "57P03"];

/// The SQLSTATE of a database error, if `error` is one.
pub(crate) fn of(error: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    match error {
        sqlx::Error::Database(e) => e.code(),
        _ => None,
    }
}

/// Whether a database error means "the database cannot be reached right now" (I/O, TLS,
/// pool timeout or closed, SQLSTATE class 08, 57P01–57P03), as opposed to a fault in
/// the request or the code. idem answers these 503 with `Retry-After`; handlers that
/// map `sqlx::Error` to responses can use this to do the same.
pub fn is_unavailable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => of(error).is_some_and(|code| {
            code.starts_with(CONNECTION_EXCEPTION_CLASS) || SHUTTING_DOWN.contains(&&*code)
        }),
    }
}

/// Whether a database error is a serialization failure (SQLSTATE 40001) or a deadlock
/// (40P01): the transaction conflicted with a concurrent one and can simply run again.
/// idem answers these at commit with 503 and `Retry-After`; a handler of an endpoint
/// with `isolation = repeatable_read` or `serializable` should answer its own
/// statements' such errors the same way (an `Err`, so nothing is stored).
pub fn is_serialization_failure(error: &sqlx::Error) -> bool {
    of(error).is_some_and(|code| code == SERIALIZATION_FAILURE || code == DEADLOCK_DETECTED)
}
