//! Reading back what RabbitMQ dead-lettered: the messages an [`AmqpConsumer`] rejected,
//! from the queue its queue's dead-letter exchange routes them to.
//!
//! RabbitMQ has no way to look at a message without taking it: each one is taken with
//! `basic.get`, unacknowledged, on a channel of its own, and all of them are put back with
//! one `basic.nack` (`requeue`, `multiple`) before the channel closes (which would put
//! them back too, as would the connection's loss).
//!
//! [`AmqpConsumer`]: super::AmqpConsumer

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicGetOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;

/// How much of a payload a [`DeadLetter`] keeps: 64 KiB, enough to read, not so much
/// that a page of them is a burden.
const PAYLOAD_KEPT: usize = 64 * 1024;

/// How many messages without RabbitMQ's `x-death` header [`dead_letters`] passes over at
/// most, beyond its `limit`.
const SKIPPED_AT_MOST: usize = 100;

/// A message RabbitMQ dead-lettered, read back from a dead-letter queue
/// ([`dead_letters`]). The fields are those of the JetStream consumer's
/// `idem::outbox::nats::DeadLetter` (feature `nats`), so that one page shows both, and
/// what RabbitMQ adds: the queue it died in, and how many times it did.
///
/// ```no_run
/// # async fn f(connection: lapin::Connection) -> Result<(), Box<dyn std::error::Error>> {
/// // As JSON, for an operator's API: the payload as text, `at` in RFC 3339.
/// let letters = idem::outbox::amqp::dead_letters(&connection, "charges_dead", 20).await?;
/// println!("{}", serde_json::to_string_pretty(&letters)?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its place in the dead-letter queue when it was read: 1 for the head (the oldest),
    /// counting the messages passed over.
    pub sequence: u64,
    /// The event's id: its `message_id` (empty when it had none, which is a reason the
    /// consumer rejects a message).
    pub event_id: String,
    /// The routing key it was consumed with: the event's topic (the first of the
    /// `routing-keys` RabbitMQ recorded when it dead-lettered the message, the delivery's
    /// routing key when it recorded none).
    pub subject: String,
    /// Why RabbitMQ dead-lettered it, starting with its word for it (`rejected`,
    /// `expired`, `maxlen` or `delivery_limit`) and naming the queue: `rejected by a
    /// consumer of the queue "charges_ledger" (its log says why)`. Why the consumer
    /// rejected it is not in the message: an [`AmqpConsumer`](super::AmqpConsumer) logs
    /// it, with the event's id, in its ERROR line `idem: message sent to the dead-letter
    /// path`.
    pub reason: String,
    /// When RabbitMQ dead-lettered it, to the second (the `time` it recorded; for a
    /// message dead-lettered more than once from the same queue for the same reason, the
    /// time that record keeps).
    #[serde(serialize_with = "crate::operate::rfc3339")]
    pub at: SystemTime,
    /// The queue it was dead-lettered from.
    pub queue: String,
    /// How many times RabbitMQ dead-lettered it, from any queue for any reason: more than
    /// one for a message that was put back in its queue and died again.
    pub deaths: u64,
    /// The event's payload, its first 64 KiB (cut at a character's boundary; as text in
    /// JSON, invalid UTF-8 replaced).
    #[serde(serialize_with = "crate::operate::lossy")]
    pub payload: Vec<u8>,
    /// The whole payload's length in bytes: more than `payload.len()` when it was cut.
    pub payload_len: usize,
}

/// The dead letters at the head of the queue `queue` (the one the consumed queue's
/// dead-letter exchange routes to), oldest first, at most `limit`: what the consumers
/// gave up on, for operators (the outbox's own dead events are in
/// [`Store::dead_events`](crate::operate::Operate::dead_page)). Messages without RabbitMQ's
/// `x-death` header were not dead-lettered, and are passed over (no more than a hundred).
///
/// Reading consumes nothing. RabbitMQ cannot show a message without delivering it, so
/// each one is taken unacknowledged on a channel opened on `connection` for this read,
/// and all are put back before it returns (a negative acknowledgement with requeue, and
/// the channel closed, which puts back what that missed; a lost connection puts them back
/// too). Then:
///
/// - a classic queue has them back in their places, in their order (RabbitMQ puts a
///   message back where it was when no other consumer of the queue is in the way); a
///   quorum queue takes them back a few milliseconds after the read returned (its count
///   shows them then), and serves returned messages first, ahead of the rest;
/// - while they are read they are out of the queue: a second read at the same time sees
///   those behind them, and a consumer of the dead-letter queue gets them after the read;
/// - RabbitMQ marks them redelivered, and up to RabbitMQ 4.2 a quorum queue counts each
///   read as a delivery: against its delivery limit (20 by default since RabbitMQ 4), the
///   messages would be dropped (or dead-lettered further) after that many reads. Make the
///   dead-letter queue a classic queue, or give it no limit (`x-delivery-limit` `-1`);
/// - a queue reads from its head only: the oldest `limit`, never the newest of a long
///   queue (JetStream's `dead_letters` reads the newest first).
///
/// Each message is one round trip to the broker: keep `limit` to a page. A stream cannot
/// be read so (RabbitMQ refuses `basic.get` on it).
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use lapin::{Connection, ConnectionProperties};
///
/// let uri = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let connection = Connection::connect(uri, ConnectionProperties::default()).await?;
/// for letter in idem::outbox::amqp::dead_letters(&connection, "charges_dead", 20).await? {
///     println!("{} {} {}", letter.event_id, letter.subject, letter.reason);
/// }
/// # Ok(()) }
/// ```
pub async fn dead_letters(
    connection: &Connection,
    queue: &str,
    limit: usize,
) -> Result<Vec<DeadLetter>, DeadLettersError> {
    let failed = |error: lapin::Error| DeadLettersError {
        queue: queue.to_owned(),
        error,
    };
    if limit == 0 {
        return Ok(Vec::new());
    }
    let channel = connection.create_channel().await.map_err(failed)?;
    let mut letters = Vec::with_capacity(limit.min(1_000));
    let mut last_tag = None;
    let read = read(&channel, queue, limit, &mut letters, &mut last_tag).await;
    put_back(&channel, queue, last_tag).await;
    read.map_err(failed)?;
    Ok(letters)
}

/// Takes up to `limit` dead letters from the head of `queue`, unacknowledged, into
/// `letters`, and the last delivery tag taken (one is taken even when it is passed over)
/// into `last_tag`.
async fn read(
    channel: &Channel,
    queue: &str,
    limit: usize,
    letters: &mut Vec<DeadLetter>,
    last_tag: &mut Option<u64>,
) -> Result<(), lapin::Error> {
    let mut taken = 0_u64;
    let most = limit.saturating_add(SKIPPED_AT_MOST) as u64;
    while letters.len() < limit && taken < most {
        let Some(message) = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        taken += 1;
        let delivery = &message.delivery;
        *last_tag = Some(delivery.delivery_tag);
        letters.extend(letter(
            taken,
            &delivery.properties,
            delivery.routing_key.as_str(),
            &delivery.data,
        ));
        // None behind it: no round trip for the `None` that would say so.
        if message.message_count == 0 {
            break;
        }
    }
    Ok(())
}

/// Puts back every message taken on `channel` (up to `last_tag`), then closes it. A
/// failure loses nothing: what is unacknowledged when the channel or its connection
/// closes goes back to the queue.
async fn put_back(channel: &Channel, queue: &str, last_tag: Option<u64>) {
    if let Some(tag) = last_tag {
        let requeue = BasicNackOptions {
            multiple: true,
            requeue: true,
        };
        if let Err(error) = channel.basic_nack(tag, requeue).await {
            tracing::warn!(%error, queue, "idem: AMQP dead letters: the read messages were not put back by a nack; closing their channel puts them back");
        }
    }
    if channel.status().connected() {
        if let Err(error) = channel.close(200, "OK".into()).await {
            tracing::warn!(%error, queue, "idem: AMQP dead letters: closing the reading channel failed; RabbitMQ puts back what it held when the connection closes");
        }
    }
}

/// The dead letter a delivery is (its `properties`, the `routing_key` it came with and
/// its `data`), the `sequence`-th of its queue; `None` without a readable `x-death`
/// header (not dead-lettered by RabbitMQ).
fn letter(
    sequence: u64,
    properties: &BasicProperties,
    routing_key: &str,
    data: &[u8],
) -> Option<DeadLetter> {
    let headers = properties.headers().as_ref()?;
    let deaths = match headers.inner().get("x-death")? {
        AMQPValue::FieldArray(deaths) => deaths.as_slice(),
        _ => return None,
    };
    // The newest first: the death that brought it here.
    let AMQPValue::FieldTable(last) = deaths.first()? else {
        return None;
    };
    let field = |name: &str| last.inner().get(name);
    let cause = field("reason").and_then(text)?;
    let at = match field("time")? {
        AMQPValue::Timestamp(seconds) => UNIX_EPOCH + Duration::from_secs(*seconds),
        _ => return None,
    };
    let queue = field("queue").and_then(text).unwrap_or_default();
    let subject = match field("routing-keys") {
        Some(AMQPValue::FieldArray(keys)) => keys.as_slice().first().and_then(text),
        _ => None,
    }
    .unwrap_or_else(|| routing_key.to_owned());
    Some(DeadLetter {
        sequence,
        event_id: properties
            .message_id()
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        subject,
        reason: reason(&cause, &queue),
        at,
        deaths: deaths
            .iter()
            .filter_map(|death| match death {
                AMQPValue::FieldTable(death) => count(death),
                _ => None,
            })
            .sum(),
        queue,
        payload: data[..cut(data, PAYLOAD_KEPT)].to_vec(),
        payload_len: data.len(),
    })
}

/// A header's text.
fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// An `x-death` record's `count`.
fn count(death: &FieldTable) -> Option<u64> {
    match death.inner().get("count")? {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        _ => None,
    }
}

/// RabbitMQ's reason for a dead-lettering (`cause`) in `queue`, said for an operator,
/// starting with RabbitMQ's word.
fn reason(cause: &str, queue: &str) -> String {
    match cause {
        "rejected" => format!("rejected by a consumer of the queue {queue:?} (its log says why)"),
        "expired" => format!("expired in the queue {queue:?} (a message TTL passed)"),
        "maxlen" => format!("maxlen: dropped by the queue {queue:?}, over its length limit"),
        "delivery_limit" => format!(
            "delivery_limit: returned to the queue {queue:?} more times than its delivery limit"
        ),
        other => format!("{other} (in the queue {queue:?})"),
    }
}

/// Where to cut `bytes` to keep at most `max` of them: at `max`, or before it so as not
/// to split a UTF-8 character (a continuation byte is never a character's first).
fn cut(bytes: &[u8], max: usize) -> usize {
    if bytes.len() <= max {
        return bytes.len();
    }
    let mut end = max;
    // A character is at most 4 bytes: at most 3 steps back.
    while end > max.saturating_sub(3) && end > 0 && bytes[end] & 0xC0 == 0x80 {
        end -= 1;
    }
    end
}

/// Why [`dead_letters`] could not read a queue: no such queue, a stream, no access to
/// it, the connection lost. It names the queue.
///
/// ```no_run
/// # async fn f(connection: lapin::Connection) {
/// match idem::outbox::amqp::dead_letters(&connection, "charges_dead", 20).await {
///     Ok(letters) => println!("{} dead letters", letters.len()),
///     // "cannot read the dead letters of the AMQP queue \"charges_dead\": ..."
///     Err(error) => eprintln!("{error}"),
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct DeadLettersError {
    queue: String,
    error: lapin::Error,
}

impl fmt::Display for DeadLettersError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot read the dead letters of the AMQP queue {:?}: {}",
            self.queue, self.error
        )
    }
}

impl std::error::Error for DeadLettersError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::ShortString;

    use super::*;

    fn table(fields: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut table = FieldTable::default();
        for (name, value) in fields {
            table.insert(ShortString::from(name), value);
        }
        table
    }

    fn long(text: &str) -> AMQPValue {
        AMQPValue::LongString(text.into())
    }

    fn death(queue: &str, reason: &str, time: u64, count: i64) -> AMQPValue {
        AMQPValue::FieldTable(table(vec![
            ("queue", long(queue)),
            ("reason", long(reason)),
            ("time", AMQPValue::Timestamp(time)),
            ("count", AMQPValue::LongLongInt(count)),
            ("exchange", long("")),
            (
                "routing-keys",
                AMQPValue::FieldArray(vec![long("charges.created")].into()),
            ),
        ]))
    }

    /// The dead letter a delivery of `data` with `headers` is.
    fn read(headers: Option<FieldTable>, data: &[u8]) -> Option<DeadLetter> {
        let mut properties = BasicProperties::default().with_message_id("evt-1".into());
        if let Some(headers) = headers {
            properties = properties.with_headers(headers);
        }
        letter(3, &properties, "charges_dead", data)
    }

    #[test]
    fn a_dead_letter_is_read_from_the_newest_death() {
        let headers = table(vec![(
            "x-death",
            AMQPValue::FieldArray(
                vec![
                    death("charges_ledger", "rejected", 1_700_000_060, 1),
                    death("charges_retry", "expired", 1_700_000_000, 2),
                ]
                .into(),
            ),
        )]);
        let letter = read(Some(headers), b"{\"charge\":1}").unwrap();
        assert_eq!(
            letter,
            DeadLetter {
                sequence: 3,
                event_id: "evt-1".into(),
                subject: "charges.created".into(),
                reason: "rejected by a consumer of the queue \"charges_ledger\" (its log says why)"
                    .into(),
                at: UNIX_EPOCH + Duration::from_secs(1_700_000_060),
                queue: "charges_ledger".into(),
                deaths: 3,
                payload: b"{\"charge\":1}".to_vec(),
                payload_len: 12,
            }
        );
        let json = serde_json::to_value(&letter).unwrap();
        assert_eq!(json["payload"], "{\"charge\":1}");
        assert_eq!(json["at"], "2023-11-14T22:14:20Z");
    }

    #[test]
    fn a_message_without_x_death_is_no_dead_letter() {
        assert_eq!(read(None, b"x"), None);
        let other = table(vec![("x-other", long("1"))]);
        assert_eq!(read(Some(other), b"x"), None);
        let empty = table(vec![("x-death", AMQPValue::FieldArray(vec![].into()))]);
        assert_eq!(read(Some(empty), b"x"), None);
    }

    #[test]
    fn reasons_start_with_rabbitmqs_word_and_name_the_queue() {
        for cause in ["rejected", "expired", "maxlen", "delivery_limit", "other"] {
            let said = reason(cause, "q");
            assert!(said.starts_with(cause), "{said}");
            assert!(said.contains("\"q\""), "{said}");
        }
    }

    #[test]
    fn a_payload_is_cut_at_a_character_boundary() {
        assert_eq!(cut(b"abc", 3), 3);
        assert_eq!(cut(b"abc", 2), 2);
        // "é" is 2 bytes, "€" 3, "𝄞" 4: never split.
        let text = "aé€𝄞".as_bytes();
        for max in 0..text.len() {
            let end = cut(text, max);
            assert!(end <= max && max - end <= 3, "{max}: {end}");
            assert!(std::str::from_utf8(&text[..end]).is_ok(), "{max}: {end}");
        }
        // Not UTF-8: cut no more than 3 bytes short.
        assert_eq!(cut(&[0x80; 10], 5), 2);
    }
}
