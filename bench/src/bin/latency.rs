//! A TCP proxy that holds back what clients send for a fixed delay: a network's round
//! trip between an application and its database, on a machine where both share loopback.
//!
//! ```sh
//! cargo run --release -p idem-bench --bin latency -- --listen 127.0.0.1:6543 \
//!     --upstream 127.0.0.1:5432 --delay-us 500
//! DATABASE_URL=postgres://postgres@127.0.0.1:6543/postgres \
//!     cargo run --release -p idem-bench -- --seconds 3 --no-growth --peer-store memory
//! ```
//!
//! Every round trip a client makes then costs at least the delay: bytes from the client
//! wait until `delay` after they arrived, in order, so messages sent together (a
//! pipeline, or several statements in one message) wait once. What the server sends
//! back is not delayed. Each connection runs on threads of its own, which sleep with the
//! operating system's timer (tens of microseconds), not a runtime's (a millisecond).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

struct Options {
    listen: String,
    upstream: String,
    delay: Duration,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        listen: "127.0.0.1:6543".to_owned(),
        upstream: "127.0.0.1:5432".to_owned(),
        delay: Duration::from_micros(500),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--listen" => options.listen = value()?,
            "--upstream" => options.upstream = value()?,
            "--delay-us" => {
                let v = value()?;
                let micros = v
                    .parse()
                    .map_err(|_| format!("--delay-us: not a number: {v}"))?;
                options.delay = Duration::from_micros(micros);
            }
            other => return Err(format!("unknown argument: {other}")),
        }
    }
    Ok(options)
}

fn main() {
    let options = match options() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("latency: {error}");
            std::process::exit(2);
        }
    };
    let listener = match TcpListener::bind(&options.listen) {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("latency: cannot listen on {}: {error}", options.listen);
            std::process::exit(1);
        }
    };
    eprintln!(
        "latency: {} -> {}, client bytes held {} µs",
        options.listen,
        options.upstream,
        options.delay.as_micros()
    );
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let upstream = options.upstream.clone();
        let delay = options.delay;
        thread::spawn(move || {
            if let Err(error) = serve(client, &upstream, delay) {
                eprintln!("latency: a connection ended: {error}");
            }
        });
    }
}

/// Relays one connection until either side closes it.
fn serve(client: TcpStream, upstream: &str, delay: Duration) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut from_client, mut to_server) = (client.try_clone()?, server.try_clone()?);
    let (mut from_server, mut to_client) = (server, client);
    let (held, release) = mpsc::channel::<(Instant, Vec<u8>)>();
    // Reads what the client sends, stamped with its arrival.
    let reader = thread::spawn(move || {
        let mut buf = vec![0; 64 * 1024];
        loop {
            match from_client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if held.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    });
    // Sends it on once its delay is over.
    let writer = thread::spawn(move || {
        for (arrived, bytes) in release {
            let due = arrived + delay;
            let now = Instant::now();
            if due > now {
                thread::sleep(due - now);
            }
            if to_server.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to_server.shutdown(Shutdown::Write);
    });
    let _ = std::io::copy(&mut from_server, &mut to_client);
    let _ = to_client.shutdown(Shutdown::Both);
    let _ = reader.join();
    let _ = writer.join();
    Ok(())
}
